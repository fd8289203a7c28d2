"""Model shapes for `--dummy-weights` runs (installed as `deepinfer.configs`)."""
