"""Runs an unmodified training script with torchrec_het installed.

    python -m torchrec_het.launch [launcher options] SCRIPT [ARGS...]
    python -m torchrec_het.launch [launcher options] -m MODULE [ARGS...]

Worker mode (no ``--nproc-per-node``; also under ``torchrun ... -m torchrec_het.launch`` and
torchx): calls ``torchrec_het.install()``, then runs SCRIPT (or MODULE) as ``__main__`` as
``python SCRIPT ARGS`` would. Processes the script starts itself with multiprocessing's spawn
(``torch.multiprocessing.spawn``, a ``spawn`` context or pool) install the plugin too, with the
same ``TORCHREC_HET_*`` settings, before they import the script
(:mod:`torchrec_het.integration.child_install` says how, and why not a ``sitecustomize``).
Launcher mode (``--nproc-per-node N``): checks the ``TORCHREC_HET_*`` settings, then starts
torchrun in this process with every worker in worker mode; ``--max-restarts R`` restarts failed
workers. A configuration error (a bad option value, a missing script, a bad setting or profile,
found here or by a worker) ends the launcher with one line and exit 2, and is never restarted.

Design (restarts, rendezvous stores, error reporting): docs/internals.md#launch
"""

import argparse
import importlib.util
import os
import runpy
import sys
import tempfile
from dataclasses import dataclass
from typing import NoReturn

PROG = "python -m torchrec_het.launch"
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
CONFIGURATION_ERROR_ENV = "TORCHREC_HET_CONFIGURATION_ERROR_FILE"  # set by the launcher for its workers
CONFIGURATION_ERROR_EXIT = 2

# launcher options: name -> (type, help); every one takes a value
_OPTIONS: dict[str, tuple[type, str]] = {
    "--nproc-per-node": (int, "workers on this node; given: launcher mode (torchrun), else worker mode"),
    "--nnodes": (str, "nodes, or MIN:MAX for an elastic job (launcher mode; default 1)"),
    "--node-rank": (int, "this node's rank, for --master-addr/--master-port (static) rendezvous"),
    "--max-restarts": (int, "times torchrun restarts all workers after a failure (launcher mode; default 0)"),
    "--rdzv-endpoint": (str, "HOST:PORT of the c10d rendezvous (launcher mode; default: a free local port)"),
    "--rdzv-id": (str, "job id shared by the nodes of one job (launcher mode)"),
    "--master-addr": (str, "address of node 0, for a static rendezvous (launcher mode)"),
    "--master-port": (int, "port on node 0, for a static rendezvous (launcher mode)"),
    "--local-addr": (str, "this node's address, which the other nodes reach it by (launcher mode)"),
    "--rdzv-conf": (str, "KEY=VALUE,... of the rendezvous, e.g. is_host=1 (launcher mode)"),
}


@dataclass(frozen=True)
class Command:
    """A parsed launcher command line.

    Attributes:
        options: launcher options by dest name (None when not given).
        script: path of the script to run, or None when ``module`` is given.
        module: module to run (``-m MODULE``), or None.
        args: the script's own arguments.
    """

    options: dict[str, object]
    script: str | None
    module: str | None
    args: list[str]

    @property
    def target(self) -> list[str]:
        """``SCRIPT ARGS...`` or ``-m MODULE ARGS...``, as given."""
        head = ["-m", self.module] if self.module is not None else [self.script]
        return [*head, *self.args]


def build_parser(with_settings: bool = False) -> argparse.ArgumentParser:
    """The launcher options (SCRIPT / -m MODULE and what follows are split off first); with
    ``with_settings`` (for ``--help``), the ``TORCHREC_HET_*`` settings after them."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [launcher options] (SCRIPT | -m MODULE) [ARGS...]",
        description="Run a TorchRec training script with torchrec_het installed (see module docstring).",
        epilog=_settings_epilog() if with_settings else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, (kind, help_text) in _OPTIONS.items():
        parser.add_argument(*_spellings(flag), type=kind, help=help_text)
    return parser


def _settings_epilog() -> str:
    """The ``TORCHREC_HET_*`` settings the workers' ``torchrec_het.install()`` reads (checked here first)."""
    from torchrec_het.integration.registration import settings_help

    return f"settings (environment variables, read by every worker; a bad value stops the launcher):\n{settings_help()}"


def _spellings(flag: str) -> list[str]:
    """``--max-restarts`` and torchrun's other spelling ``--max_restarts``."""
    other = "--" + flag[2:].replace("-", "_")
    return [flag] if other == flag else [flag, other]


def parse_command(argv: list[str]) -> Command:
    """Splits ``argv`` at SCRIPT (or ``-m MODULE``) the way ``python`` does; exits 2 on bad options."""
    parser = build_parser()
    known = {spelling for flag in _OPTIONS for spelling in _spellings(flag)}
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg in ("-h", "--help"):
            build_parser(with_settings=True).print_help()
            sys.exit(0)
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            module = arg[2:] or (argv[index + 1] if index + 1 < len(argv) else "")
            if not module:
                parser.error("argument -m: expected a module name")
            rest = argv[index + (1 if arg[2:] else 2) :]
            return Command(vars(parser.parse_args(argv[:index])), None, module, rest)
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            if name not in known:
                parser.error(f"unknown launcher option {name!r} (script arguments go after SCRIPT)")
            index += 1 if "=" in arg else 2
            continue
        return Command(vars(parser.parse_args(argv[:index])), arg, None, argv[index + 1 :])
    parser.error("no SCRIPT or -m MODULE given")
    raise AssertionError("unreachable")


def run_worker(command: Command) -> None:
    """Installs the plugin and runs the script or module as ``__main__`` in this process."""
    if command.module is not None:
        _require_module(command.module)
    else:
        _require_script(command.script)

    import torchrec_het
    from torchrec_het.errors import ConfigurationError
    from torchrec_het.integration.child_install import reach_spawned_children
    from torchrec_het.integration.collective_errors import CollectiveFailure, describe_collective_error

    try:
        torchrec_het.install()
    except ValueError as error:  # a bad TORCHREC_HET_* value or profile (the launcher checked it first)
        report_configuration_error(error)
    reach_spawned_children()
    try:
        if command.module is not None:
            sys.argv = [command.module, *command.args]  # runpy puts the module's file in argv[0]
            runpy.run_module(command.module, run_name="__main__", alter_sys=True)
        else:
            script = command.script
            sys.argv = [script, *command.args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would
            runpy.run_path(script, run_name="__main__")
    except ConfigurationError as error:
        report_configuration_error(error)
    except Exception as error:  # a lost peer or link: one line that says so ends the traceback
        described = describe_collective_error(error, _default_group_timeout_s())
        if described is None:
            raise
        raise CollectiveFailure(described) from error


def report_configuration_error(error: Exception) -> NoReturn:
    """Ends a worker on a setting that does not fit the model: under the launcher, its message goes
    to the launcher's file and the worker exits 0 (torchrun restarts nothing; the launcher prints
    the line and exits 2); otherwise the worker prints the line and exits 2."""
    path = os.environ.get(CONFIGURATION_ERROR_ENV)
    if not path:
        configuration_error(str(error))
    line = _one_line(str(error))
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as out:
        out.write(line)
    os.replace(partial, path)  # every rank writes the same line; the last one stays
    sys.exit(0)


def configuration_error(message: str) -> NoReturn:
    """Ends this process on a configuration error: ``message`` as one line on stderr, exit 2."""
    print(_one_line(message), file=sys.stderr, flush=True)
    raise SystemExit(CONFIGURATION_ERROR_EXIT)


def _one_line(message: str) -> str:
    return f"{PROG}: {' '.join(message.split())}"


def torchrun_argv(command: Command) -> list[str]:
    """torchrun's command line that runs ``command``'s target in worker mode on every worker."""
    options = command.options
    argv = ["--nproc-per-node", str(options["nproc_per_node"])]
    argv += ["--nnodes", str(options["nnodes"] or "1")]
    argv += ["--max-restarts", str(options["max_restarts"] or 0)]
    if options["rdzv_endpoint"] is not None:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", str(options["rdzv_endpoint"])]
    for name in ("rdzv_id", "rdzv_conf", "node_rank", "master_addr", "master_port", "local_addr"):
        if options[name] is not None:
            argv += [f"--{name.replace('_', '-')}", str(options[name])]
    return [*argv, "-m", "torchrec_het.launch", *command.target]


def run_launcher(command: Command) -> int:
    """Runs torchrun in this process; returns the exit code (1 when a worker failed for good)."""
    if command.options["nproc_per_node"] < 1:
        configuration_error(f"--nproc-per-node must be >= 1, got {command.options['nproc_per_node']}")
    if (command.options["max_restarts"] or 0) < 0:
        configuration_error(f"--max-restarts must be >= 0, got {command.options['max_restarts']}")
    if command.module is not None:  # fail here once, not in every worker
        _require_module(command.module)
    else:
        _require_script(command.script)
    _require_settings()
    _share_machine()

    if command.options["max_restarts"]:
        # torchrun shares its rendezvous TCPStore with the workers by default and keeps it
        # across restarts, so restarted workers can read the dead attempt's gloo/NCCL
        # addresses and fail to connect (pytorch/pytorch#135712, #167288). A store per
        # attempt (hosted by worker rank 0) avoids that.
        os.environ.setdefault(SHARE_STORE_ENV, "1")

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    with tempfile.TemporaryDirectory(prefix="torchrec_het_launch_") as folder:
        errors = os.path.join(folder, "configuration_error")
        os.environ[CONFIGURATION_ERROR_ENV] = errors
        try:
            torchrun_main(torchrun_argv(command))
            code = 0
        except ChildFailedError:
            code = 1  # torchrun has printed which worker failed and why
        finally:
            del os.environ[CONFIGURATION_ERROR_ENV]
        if os.path.exists(errors):  # a worker found a setting that does not fit the model
            with open(errors) as found:
                print(found.read().strip(), file=sys.stderr, flush=True)
            return CONFIGURATION_ERROR_EXIT
    return code


def main(argv: list[str] | None = None) -> int:
    command = parse_command(sys.argv[1:] if argv is None else argv)
    if command.options["nproc_per_node"] is not None:
        return run_launcher(command)
    run_worker(command)
    return 0


def _default_group_timeout_s() -> float | None:
    """The default process group's timeout in seconds, while it exists."""
    import torch.distributed as dist

    from torchrec_het._compat import process_group_timeout

    if not (dist.is_available() and dist.is_initialized()):
        return None
    timeout = process_group_timeout(None)
    return timeout.total_seconds() if timeout is not None else None


def _require_script(script: str | None) -> None:
    if script is None or not os.path.isfile(script):
        configuration_error(f"can't open SCRIPT {script!r}: no such file")


def _require_settings() -> None:
    """The ``TORCHREC_HET_*`` settings and the profile they name, checked once here before any worker starts."""
    from torchrec_het.integration.env_settings import check_environment

    try:
        check_environment()
    except ValueError as error:
        configuration_error(str(error))


def _share_machine() -> None:
    """Nodes of one job on one machine (emulated hosts) say how many ranks share its cores
    (``$TORCHREC_HET_RANKS_ON_MACHINE``): workers then get ``cores // N`` intra-op threads
    (:mod:`torchrec_het.integration.cpu_budget`), unless ``OMP_NUM_THREADS`` is set; else torchrun's rule."""
    from torchrec_het.integration.cpu_budget import budget_for, stated_ranks_on_machine

    ranks = stated_ranks_on_machine()  # checked by _require_settings
    if ranks is not None and "OMP_NUM_THREADS" not in os.environ:
        budget = budget_for(ranks)
        os.environ["OMP_NUM_THREADS"] = str(budget.threads_per_rank)
        if budget.warning():
            print(f"{PROG}: {budget.warning()}", file=sys.stderr, flush=True)


def _require_module(module: str) -> None:
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as error:
        configuration_error(f"can't find module {module!r} (-m): {error}")
    if found is None:
        configuration_error(f"no module named {module!r} (-m)")


if __name__ == "__main__":
    sys.exit(main())
