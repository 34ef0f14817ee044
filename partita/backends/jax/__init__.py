"""The JAX backend: ``emit.py`` writes ``program_jax.py`` from a Plan; the other modules are the runtime it imports (jax.jit with NamedShardings)."""
