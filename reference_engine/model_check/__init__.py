"""A model-checked PD handoff: the reference engine's prefill/decode protocol in Promela.

See `pd_handoff.pml` for what the model knows, `runner` for running spin over the fix
combinations, `trail` for rendering a counterexample and `scenario` for turning one into a
scenario `kvcanary repro` runs against the bundled engine.
"""
