"""`deepspeed.monitor.utils`: whether each monitor's library is installed
(`minispeed.profiler.monitor.library`: an `ImportError` naming the `pip install` when not)."""

from minispeed.profiler.monitor import library

__all__ = ["check_comet_availability", "check_tb_availability", "check_wandb_availability"]


def check_tb_availability() -> None:
    """Raise `ImportError` unless `tensorboard` is installed."""
    library("tensorboard")


def check_wandb_availability() -> None:
    """Raise `ImportError` unless `wandb` is installed."""
    library("wandb")


def check_comet_availability() -> None:
    """Raise `ImportError` unless `comet_ml` 3.41.0 or newer is installed."""
    library("comet")
