"""Frontends: capture a torch module or a JAX function as the IR (first stage of the flow, above ``passes/``)."""
