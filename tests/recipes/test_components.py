"""The torchx components validate and pass only arguments their scripts accept."""

import shlex

from torchx.components.component_test_base import ComponentTestCase

from torchrec_het.bench.__main__ import parse_args
from torchrec_het.recipes import components


def _torchrun_argv(app) -> list[str]:
    role = app.roles[0]
    assert role.entrypoint == "bash" and role.args[0] == "-c", role.args
    return shlex.split(role.args[1])


class BenchComponentTest(ComponentTestCase):
    def test_validates(self) -> None:
        self.validate(components, "bench")

    def test_arguments_are_accepted_by_the_benchmark(self) -> None:
        app = components.bench(preset="default", configs="stock_table_wise,stock_row_wise", out="/tmp/x", j="1x3")
        argv = _torchrun_argv(app)
        self.assertEqual(argv[0], "torchrun")
        self.assertEqual(argv[argv.index("--nproc_per_node") + 1], "3")
        module_at = argv.index("-m")
        self.assertEqual(argv[module_at + 1], "torchrec_het.bench")
        parsed = parse_args(argv[module_at + 2 :])
        self.assertEqual(parsed.preset, "default")
        self.assertEqual(parsed.configs, "stock_table_wise,stock_row_wise")
        self.assertEqual(parsed.out, "/tmp/x")
        self.assertTrue(parsed.no_progress)

    def test_defaults_are_accepted_by_the_benchmark(self) -> None:
        argv = _torchrun_argv(components.bench())
        parsed = parse_args(argv[argv.index("-m") + 2 :])
        self.assertEqual(parsed.preset, "smoke")
        self.assertEqual(parsed.configs, "")
