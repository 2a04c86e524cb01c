"""Capture scaled out on Ray: one actor per GPU (or per CPU slot), sharing ``--threads``.

    driver:  the run's one lifecycle (:func:`capture.run.run_lifecycle`): it locks and starts
             the run (it owns the manifest) and commits it; this executor starts the actors
    actor:   load model + draft once; for each prompt it is handed, decode and write the
             prompt's parts into the same run folder, ``sequences`` last
    driver:  hands prompts out from one queue (whichever actor is free) and records progress in
             the manifest as prompts complete

``--workers N`` starts a local Ray cluster for the run; ``--ray-address ADDR`` joins an existing
one (every node must reach ``--out``: a shared filesystem, or an object store, whose
``--storage-options`` the actors get with the root). Resume works across any worker count
(a prompt is complete when its ``sequences`` part exists), and for the same seed and settings
the tables equal a single-process run's: each prompt is decoded with seed + its index by a
worker with the same model, whatever worker it lands on.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from moe_spec import console
from moe_spec.capture.background import BackgroundWriter, WriterFailed
from moe_spec.capture.settings import CaptureError, CaptureSettings
from moe_spec.capture.target import Target
from moe_spec.catalog import location
from moe_spec.catalog.writer import RunWriter
from moe_spec.cluster import ClusterError, actor_failure, cap_workers, count_workers, init_ray, worker_options


class CaptureWorker:
    """A Ray actor: one model and draft head, capturing whatever prompts it is handed."""

    def __init__(self, settings, out: Path, run: str, role: str, prompts: list,
                 threads: int = 1):  # the driver's --threads divided among the actors
        # ``out``: the driver's traces root as a path object, never its text: an s3:// root
        # carries the driver's --storage-options with it (a node's own environment may lack them)
        import torch
        torch.set_num_threads(threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.target = Target.load(settings, location.root(out), prompts)
        self.writer = RunWriter(out, self.target.loaded.name, settings.bench, run)
        self.run, self.role, self.prompts = run, role, prompts

    def manifest(self) -> dict:
        return self.target.manifest(self.run, self.role, self.prompts)

    def capture(self, index: int, prompt) -> tuple[int, int, float]:
        """(trees, accepted tokens, seconds) of one prompt, written completely."""
        start = time.perf_counter()
        background = BackgroundWriter()
        try:
            gen = self.target.capture_prompt(index, prompt, self.writer, background)
            background.drain()
        finally:
            background.close()
        return (len(gen.steps), sum(s.accepted_length for s in gen.steps),
                time.perf_counter() - start)


class RayExecutor:
    """The prompts of a run spread over Ray actors (:class:`CaptureWorker`), for
    :func:`capture.run.run_lifecycle`."""

    def __init__(self, settings: CaptureSettings, out: Path, run: str, role: str, prompts: list,
                 *, workers: int, ray_address: str | None):
        self.settings, self.out, self.run, self.role, self.prompts = \
            settings, out, run, role, prompts
        self.workers, self.ray_address = workers, ray_address
        self.actors: list = []
        self.label = ""

    def load(self) -> dict:
        """Start (or join) the cluster and the actors; every actor's model is loaded before
        prompts are handed out."""
        settings = self.settings
        workers = cap_workers(self.workers, len(self.prompts), settings.device,
                              local=not self.ray_address)
        try:
            self.ray = ray = init_ray(workers, self.ray_address)
        except ClusterError as exc:
            raise CaptureError(str(exc)) from None
        n = count_workers(ray, workers, settings.device, items=len(self.prompts))
        self.label = f" ({n} workers)"
        actor = ray.remote(**worker_options(settings.device))(CaptureWorker)
        # a local cluster shares this process's --threads; a joined one gives each actor its slot
        threads = 1 if self.ray_address else console.threads.share(n)
        self.actors = [actor.remote(settings, self.out, self.run, self.role, self.prompts,
                                    threads) for _ in range(n)]
        try:
            return ray.get([a.manifest.remote() for a in self.actors])[0]
        except ray.exceptions.RayTaskError as exc:  # the model, draft or budget could not load
            raise CaptureError(str(exc.cause) if exc.cause else actor_failure(exc)) from None
        except ray.exceptions.RayActorError as exc:  # died in __init__: store, model, node
            raise CaptureError(f"a capture worker could not start ({actor_failure(exc)}); "
                               "check --model, --out and --storage-options on every node") \
                from None

    def capture(self, todo, writer, on_complete):
        """Whichever actor is free takes the next prompt; the driver records the progress as
        each one comes back written. A worker's failure to write is the lifecycle's write
        error; any other failure is named as the worker's."""
        ray = self.ray
        pool = ray.util.ActorPool(self.actors)
        try:
            for trees, accepted, _ in pool.map_unordered(lambda a, item: a.capture.remote(*item),
                                                         todo):
                on_complete()
                yield trees, accepted
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, (OSError, WriterFailed)):
                raise cause
            raise CaptureError(f"a capture worker failed: {cause or exc}; the run keeps its "
                               "complete prompts, rerun to resume") from None

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
