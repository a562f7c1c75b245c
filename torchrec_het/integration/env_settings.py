"""The ``TORCHREC_HET_*`` environment settings: each once (:data:`SETTINGS`), read and checked
(:func:`env_settings`, :func:`check_environment`), with errors that name the variable."""

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from torchrec_het.planner.access import check_not_empty
from torchrec_het.planner.compute_costs import ENV_COSTS, ComputeCosts, load_compute_costs
from torchrec_het.planner.compute_probe import parse_step_compute
from torchrec_het.planner.network import parse_link_gbit, parse_switch
from torchrec_het.replication.profile import AccessProfile, load_profile


def parse_timeout(text: str, name: str) -> timedelta:
    """A number of seconds > 0, as a ``timedelta``.

    Raises:
        ValueError: naming ``name``.
    """
    try:
        seconds = float(text)
    except ValueError:
        seconds = None
    if seconds is None or not 0 < seconds < float("inf"):
        raise ValueError(f"{name} must be a number of seconds > 0, got {text!r}")
    return timedelta(seconds=seconds)


@dataclass(frozen=True)
class Setting:
    """One ``TORCHREC_HET_*`` setting ``install()`` reads when its argument is not given.

    Attributes:
        variable: the environment variable.
        argument: its key in :func:`env_settings`: the ``install()`` argument it stands for, if any.
        kind: ``str`` (taken as given), ``int`` or ``float`` (checked against ``minimum``).
        parse: where given, turns the text into the value (and raises naming the variable).
        minimum: the least number allowed.
        default: the value when unset.
        help: what it does (``python -m torchrec_het.launch --help`` lists it).
    """

    variable: str
    argument: str
    kind: type
    help: str
    minimum: float = 0
    default: object = None
    parse: Callable[[str, str], object] | None = None  # (text, variable) -> value; replaces ``kind``


# Every setting, once: env_settings() reads these and the launcher's --help lists them.
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "TORCHREC_HET_PROFILE",
        "profile",
        str,
        "access profile (iopath path): the planner may choose the plugin's types for the tables it names",
    ),
    Setting(
        "TORCHREC_HET_ALPHA",
        "alpha",
        float,
        "a Zipf skew you state (>= 0): het_cached_row_wise may be chosen for every table",
    ),
    Setting(
        "TORCHREC_HET_ONLINE_PROFILE_STEPS",
        "online_profile_steps",
        int,
        "without a profile, het_row_replicated tables count reads in their first N steps (default 0: off)",
        default=0,
    ),
    Setting(
        "TORCHREC_HET_REPLICA_SYNC_EVERY",
        "replica_sync_every",
        int,
        "replica sync interval of het_row_replicated tables (default 1: exact)",
        minimum=1,
        default=1,
    ),
    Setting(
        "TORCHREC_HET_LOOKAHEAD",
        "lookahead",
        str,
        "1: het_row_replicated bags look one batch ahead under TrainPipelineSparseDist (exact; default 0)",
        parse=parse_switch,
    ),
    Setting(
        "TORCHREC_HET_EMBEDDING_STALENESS",
        "embedding_staleness",
        int,
        "k >= 0: the script's TrainPipelineSparseDist is the hybrid pipeline with bound k",
    ),
    Setting(
        ENV_COSTS,
        "compute_costs",
        str,
        "compute-cost table the planner prices with (python -m torchrec_het_bench.calibrate)",
    ),
    Setting(
        "TORCHREC_HET_PG_TIMEOUT",
        "pg_timeout",
        float,
        "process group timeout in seconds, for the script's init_process_group calls that pass none "
        "(default torch's: 30 minutes for gloo)",
        parse=parse_timeout,
    ),
    Setting(
        "TORCHREC_HET_LINK_GBIT",
        "link_gbit",
        str,
        "INTRA,INTER: link figures in Gbit/s per rank the planner prices with instead of measuring them "
        "(either may be empty)",
        parse=parse_link_gbit,
    ),
    Setting(
        "TORCHREC_HET_STEP_COMPUTE",
        "step_compute",
        str,
        "LOOKUP_NS,DENSE_US: the compute the planner prices with instead of measuring it (a lookup's forward, "
        "backward and update in ns per id; the dense part's in us per sample)",
        parse=parse_step_compute,
    ),
    Setting(
        "TORCHREC_HET_LINK_PROBE",
        "link_probe",
        str,
        "0 turns the planner's link probe off (default 1): what is not stated is assumed",
        parse=parse_switch,
    ),
    Setting(
        "TORCHREC_HET_RANKS_ON_MACHINE",
        "ranks_on_machine",
        int,
        "ranks sharing this machine's cores (emulated hosts on one machine): the launcher gives each worker "
        "cores // N intra-op threads unless OMP_NUM_THREADS is set (default: torchrun's rule)",
        minimum=1,
    ),
)
SETTING_OF = {setting.argument: setting for setting in SETTINGS}
ENV_PROFILE, ENV_ALPHA = SETTING_OF["profile"].variable, SETTING_OF["alpha"].variable
ENV_SYNC, ENV_ONLINE = SETTING_OF["replica_sync_every"].variable, SETTING_OF["online_profile_steps"].variable
ENV_STALENESS, ENV_COMPUTE = SETTING_OF["embedding_staleness"].variable, SETTING_OF["compute_costs"].variable
ENV_PG_TIMEOUT = SETTING_OF["pg_timeout"].variable  # seconds
ENV_LINK_GBIT, ENV_LINK_PROBE = SETTING_OF["link_gbit"].variable, SETTING_OF["link_probe"].variable
ENV_RANKS_ON_MACHINE = SETTING_OF["ranks_on_machine"].variable
ENV_STEP_COMPUTE = SETTING_OF["step_compute"].variable
PROFILE_HINT = "python -m torchrec_het_bench.profile, or torchrec_het.replication.AccessProfiler on your own batches"


def env_settings() -> dict:
    """The ``TORCHREC_HET_*`` settings from the environment (None where unset), checked.

    Raises:
        ValueError: a malformed value; the message names the variable.
    """
    return {setting.argument: env_value(setting) for setting in SETTINGS}


def check_environment() -> None:
    """What the launcher checks before it starts any worker: every ``TORCHREC_HET_*`` value, and
    that ``$TORCHREC_HET_PROFILE`` (when set) is a readable, non-empty profile and
    ``$TORCHREC_HET_COMPUTE_COSTS`` (when set) a readable compute-cost table.

    Raises:
        ValueError: naming the variable (and the path).
    """
    env = env_settings()
    path = env["profile"]
    if path is not None:
        check_not_empty(read_profile(path, f"${ENV_PROFILE}"), f"${ENV_PROFILE}={path}")
    if env["compute_costs"] is not None:
        read_compute_costs(env["compute_costs"], f"${ENV_COMPUTE}")


def read_compute_costs(path: str, origin: str) -> ComputeCosts:
    """``load_compute_costs(path)``, with errors that say where the path came from (``origin``)."""
    try:
        return load_compute_costs(path)
    except ValueError as error:
        raise ValueError(f"{origin}={path!r}: {error}") from None


def read_profile(path: str, origin: str) -> AccessProfile:
    """``load_profile(path)``, with errors that say where the path came from (``origin``)."""
    try:
        return load_profile(path)
    except FileNotFoundError:
        raise ValueError(f"{origin}={path!r}: no such access profile file") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"{origin}={path!r}: cannot read the access profile ({error})") from None


def env_value(setting: Setting):
    """``setting``'s value from the environment (its default when unset or empty), checked."""
    text = os.environ.get(setting.variable, "").strip()
    if not text:
        return setting.default
    if setting.parse is not None:
        return setting.parse(text, setting.variable)
    if setting.kind is str:
        return text
    try:
        value = setting.kind(text)
    except ValueError:
        value = None
    if value is None or not value >= setting.minimum:
        what = "an int" if setting.kind is int else "a number"
        raise ValueError(f"{setting.variable} must be {what} >= {setting.minimum:g}, got {text!r}")
    return value
