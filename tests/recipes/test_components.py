"""The torchx components validate and pass only arguments their scripts accept (no processes)."""

import shlex
from pathlib import Path

from torchx.components.component_test_base import ComponentTestCase

from torchrec_het.launch import parse_command
from torchrec_het_bench.__main__ import parse_args
from torchrec_het_bench.recipes import components, train_dlrm
from torchrec_het_bench.recipes.components import LAUNCHER, RECIPE


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
        self.assertEqual(argv[module_at + 1], "torchrec_het_bench")
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


def _recipe_args(app) -> list[str]:
    """What the recipe's parser gets: the role's arguments after ``-m torchrec_het.launch -m <recipe>``."""
    argv = _torchrun_argv(app)
    launcher_at = argv.index(LAUNCHER)
    assert argv[launcher_at - 1] == "-m", argv
    command = parse_command(argv[launcher_at + 1 :])
    assert command.module == RECIPE, argv
    assert command.options["nproc_per_node"] is None, "the launcher must run in worker mode under torchrun"
    return command.args


class RecipeComponentsTest(ComponentTestCase):
    def test_validate(self) -> None:
        self.validate(components, "train")
        self.validate(components, "evaluate")

    def test_train_arguments_are_accepted_by_the_recipe(self) -> None:
        app = components.train(
            steps=7, preset="default", data="/data/criteo", batch_size=64, learning_rate=0.1, seed=3,
            checkpoint_path="file:///tmp/ckpt", checkpoint_every=2, resume=True, eval_batches=5,
            print_plan=True, save_weights="/tmp/w.pt", fwd_comm_precision="fp16", bwd_comm_precision="bf16", j="1x3",
        )  # fmt: skip
        argv = _torchrun_argv(app)
        self.assertEqual(argv[argv.index("--nproc_per_node") + 1], "3")
        args = train_dlrm.build_parser().parse_args(_recipe_args(app))
        self.assertEqual(
            (args.steps, args.preset, args.data, args.batch_size, args.learning_rate, args.seed),
            (7, "default", "/data/criteo", 64, 0.1, 3),
        )
        self.assertEqual((args.checkpoint_path, args.checkpoint_every, args.eval_batches), ("file:///tmp/ckpt", 2, 5))
        self.assertTrue(args.resume and args.print_plan and not args.evaluate_only)
        self.assertEqual(args.save_weights, "/tmp/w.pt")
        self.assertEqual((str(args.fwd_comm_precision), str(args.bwd_comm_precision)), ("fp16", "bf16"))
        self.assertEqual(train_dlrm.parse_args(_recipe_args(app)).checkpoint_dir, Path("/tmp/ckpt"))

    def test_defaults_are_accepted_by_the_recipe(self) -> None:
        for component in (components.train, components.evaluate):
            with self.subTest(component=component.__name__):
                args = train_dlrm.parse_args(_recipe_args(component()))
                self.assertEqual((args.data, args.save_weights), (None, None))  # '' means unset
        train = train_dlrm.parse_args(_recipe_args(components.train(resume=False, print_plan=False)))
        self.assertFalse(train.resume or train.print_plan)

    def test_evaluate_arguments_are_accepted_by_the_recipe(self) -> None:
        app = components.evaluate(checkpoint_path="/tmp/ckpt", preset="default", seed=2, eval_batches=9)
        args = train_dlrm.parse_args(_recipe_args(app))
        self.assertTrue(args.evaluate_only)
        self.assertEqual(
            (args.checkpoint_path, args.preset, args.seed, args.eval_batches), ("/tmp/ckpt", "default", 2, 9)
        )
