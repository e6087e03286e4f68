"""The chaos flags' cross-checks: `partition` needs a command that reaches a host's link.

The fault itself is in `slime_like/chaos/partition.py`; what the command must do is said
there and in docs/FAULT_TOLERANCE.md (A partitioned node).
"""

from __future__ import annotations

import argparse
import shlex
import string

from slime_like.errors import ConfigError

PARTITION = "partition"
PARTITION_PLACEHOLDERS = ("node_ip", "seconds")
PARTITION_COMMAND_FLAG = "--chaos-partition-command"


def check_partition_command(template: str | None) -> list[str]:
    """The words of `template`, a command with exactly {node_ip} and {seconds}; a
    ConfigError naming the flag otherwise."""
    if not template or not template.strip():
        raise ConfigError(PARTITION_COMMAND_FLAG, "the chaos fault `partition` needs a command "
                          "that cuts the host {node_ip}'s cluster link and restores it after "
                          "{seconds} by itself (e.g. a switch's API); none was given")
    try:
        words = shlex.split(template)
    except ValueError as e:
        raise ConfigError(PARTITION_COMMAND_FLAG, f"{template!r} is not a command: {e}") from None
    try:
        names = {name for w in words for _, name, _, _ in string.Formatter().parse(w) if name}
    except ValueError as e:
        raise ConfigError(PARTITION_COMMAND_FLAG, f"{template!r}: {e}") from None
    unknown = names - set(PARTITION_PLACEHOLDERS)
    missing = set(PARTITION_PLACEHOLDERS) - names
    if unknown or missing:
        raise ConfigError(PARTITION_COMMAND_FLAG, f"{template!r} must use the placeholders "
                          "{node_ip} and {seconds} and no others (missing "
                          f"{sorted(missing)}, unknown {sorted(unknown)})")
    return words


def check_chaos(args: argparse.Namespace) -> None:
    """`partition` among --chaos-faults needs --chaos-partition-command (and a chaos run);
    the command alone is refused too, as a flag that would do nothing."""
    faults = args.chaos_faults or ()
    if PARTITION in faults and args.chaos_seed is not None:
        check_partition_command(args.chaos_partition_command)
    elif args.chaos_partition_command is not None:
        raise ConfigError(PARTITION_COMMAND_FLAG, "given, but no chaos run has the fault "
                          "`partition` (--chaos-seed N --chaos-faults partition ...)")
