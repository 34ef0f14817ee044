"""The PyTorch backend: ``emit.py`` writes ``program_torch.py`` from a Plan; the other modules are the runtime it imports (torchrun + DTensor/FSDP2/pipelining)."""
