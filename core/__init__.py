"""deepinfer's engine core (installed as `deepinfer.core`); the public API is `deepinfer`'s."""
