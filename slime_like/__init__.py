"""slime_like: Ray-orchestrated SGLang rollout engines for RL training."""

__version__ = "0.1.0"
