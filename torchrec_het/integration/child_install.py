"""The plugin in the processes a launched script starts itself with multiprocessing.

``python -m torchrec_het.launch`` installs the plugin in its worker process before the script
runs. A script that starts its ranks itself (``torch.multiprocessing.spawn``, a ``spawn`` or
``forkserver`` context, a process pool of one; TorchRec's ``benchmark_train_pipeline`` does)
gets fresh interpreters that know nothing of that. :func:`reach_spawned_children` makes every
such child install the plugin too, before it imports the script:

multiprocessing sends a child its *preparation data* (a pickled dict: sys.path, argv, the main
module to import) and only then the process object. The child unpickles the dict, then
``multiprocessing.spawn.prepare`` reads the keys it knows and imports the parent's
``__main__``. The launcher adds one key whose value unpickles by calling
:func:`install_in_child`: the child installs the plugin (with the ``TORCHREC_HET_*`` settings
it inherits in its environment, as the launcher's worker read them) before the script's module
binds ``get_default_sharders`` or ``EmbeddingShardingPlanner`` by name, and arms the same hook
for its own children. ``fork`` children need nothing: they inherit the installed modules.

Why not a ``sitecustomize`` module on ``PYTHONPATH``: it would run in every Python process the job
starts (tools, ``pip``, helper scripts), each then importing torch to install; and it shadows the
interpreter's own ``sitecustomize`` (Debian's Python ships one). The preparation data reaches
exactly the processes multiprocessing starts to run the script's code, and nothing else.

A child in which TorchRec cannot be imported (another ``multiprocessing.set_executable``) is left
as it is. ``install()`` replaces what it installed before, so a child that installs the plugin
itself ends with one installation.
"""

import functools
import importlib.util
import multiprocessing.spawn

PREPARATION_KEY = "torchrec_het_install"  # multiprocessing's prepare() ignores keys it does not know


class _InstallOnUnpickle:
    """The preparation data's value that installs the plugin in the child that unpickles it."""

    def __reduce__(self):
        return (install_in_child, ())


def reach_spawned_children() -> None:
    """Makes the processes multiprocessing starts from here (spawn, forkserver) install the plugin
    before they import the script; idempotent."""
    stock = multiprocessing.spawn.get_preparation_data
    if getattr(stock, "reaches_children", False):
        return

    @functools.wraps(stock)
    def get_preparation_data(name: str) -> dict:
        data = stock(name)
        data[PREPARATION_KEY] = _InstallOnUnpickle()
        return data

    get_preparation_data.reaches_children = True
    multiprocessing.spawn.get_preparation_data = get_preparation_data  # popen_spawn_* / forkserver look it up


def install_in_child() -> None:
    """In a child multiprocessing started: installs the plugin quietly (the launcher's worker said
    which pricing rule applies) and passes the hook on; nothing where TorchRec is missing."""
    if importlib.util.find_spec("torchrec") is None:
        return
    from torchrec_het.integration.registration import install

    install(announce=False)
    reach_spawned_children()
