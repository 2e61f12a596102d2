"""The demo's task (``ravq.tasks.charlm``) without its optional recipe hooks, so bench_recipe.py can turn
training metrics and evaluation off: ``benchmarks.recipe_task:plain``."""

from __future__ import annotations

from types import SimpleNamespace

from ravq.tasks import charlm

plain = SimpleNamespace(build_model=charlm.build_model, example_inputs=charlm.example_inputs,
                        loss_fn=charlm.loss_fn, train_batches=charlm.train_batches,
                        make_optimizer=charlm.make_optimizer, split_points=charlm.split_points)
