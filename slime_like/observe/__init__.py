"""The operator's view of a run: report folder, plots, incidents, tracking, console progress."""

from slime_like.observe.observers import RunObservers

__all__ = ["RunObservers"]
