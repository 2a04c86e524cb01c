"""Capture scaled out on Ray: one actor per GPU (or per CPU slot), sharing ``--threads``.

    driver:  lock and start the run (it owns the manifest), start the actors
    actor:   load model + draft once; for each prompt it is handed, decode and write the
             prompt's parts into the same run folder, ``sequences`` last
    driver:  hands prompts out from one queue (whichever actor is free), records progress in
             the manifest as prompts complete, marks the run complete

``--workers N`` starts a local Ray cluster for the run; ``--ray-address ADDR`` joins an existing
one (every node must see ``--out``: a shared filesystem). Resume works across any worker count
(a prompt is complete when its ``sequences`` part exists), and for the same seed and settings
the tables equal a single-process run's: each prompt is decoded with seed + its index by a
worker with the same model, whatever worker it lands on.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tqdm import tqdm

import console
from capture.writer import CaptureError, RunWriter
from cluster import ClusterError, cap_workers, count_workers, init_ray, worker_options


class CaptureWorker:
    """A Ray actor: one model and draft head, capturing whatever prompts it is handed."""

    def __init__(self, settings, out: str, run: str, role: str, prompts: list,
                 threads: int = 1):  # the driver's --threads divided among the actors
        import torch

        from capture.run import Target
        torch.set_num_threads(threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.target = Target.load(settings, Path(out), prompts)
        self.writer = RunWriter(out, self.target.loaded.name, settings.bench, run)
        self.run, self.role, self.prompts = run, role, prompts

    def manifest(self) -> dict:
        return self.target.manifest(self.run, self.role, self.prompts)

    def capture(self, index: int, prompt) -> tuple[int, int, float]:
        """(trees, accepted tokens, seconds) of one prompt, written completely."""
        from capture.background import BackgroundWriter
        start = time.perf_counter()
        background = BackgroundWriter()
        try:
            gen = self.target.capture_prompt(index, prompt, self.writer, background)
            background.drain()
        finally:
            background.close()
        return (len(gen.steps), sum(s.accepted_length for s in gen.steps),
                time.perf_counter() - start)


def capture_distributed(settings, out: Path, run: str, role: str, prompts: list, *,
                        workers: int, ray_address: str | None, benchmarks_root, progress: bool,
                        start: float):
    from capture.background import WriterFailed
    from capture.run import runs_row, summarise
    workers = cap_workers(workers, len(prompts), settings.device, local=not ray_address)
    try:
        ray = init_ray(workers, ray_address)
    except ClusterError as exc:
        raise CaptureError(str(exc)) from None
    n = count_workers(ray, workers, settings.device, items=len(prompts))
    actor = ray.remote(**worker_options(settings.device))(CaptureWorker)
    # a local cluster shares this process's --threads; a joined one gives each actor its slot
    threads = 1 if ray_address else console.threads.share(n)
    actors = [actor.remote(settings, str(out), run, role, prompts, threads) for _ in range(n)]
    try:
        # every actor's model loaded before prompts are handed out
        manifest_fields = ray.get([a.manifest.remote() for a in actors])[0]
    except ray.exceptions.RayTaskError as exc:  # the model, draft or budget could not load
        raise CaptureError(str(exc.cause) if exc.cause else str(exc)) from None
    load_seconds = time.perf_counter() - start
    writer = RunWriter(out, manifest_fields["model"], settings.bench, run)
    try:
        manifest, done = writer.start(manifest_fields)
        resumed = len(done)
        todo = [(settings.offset + i, p) for i, p in enumerate(prompts)
                if settings.offset + i not in done]
        pool = ray.util.ActorPool(actors)
        bar = tqdm(total=len(todo), desc=f"capture {manifest['model']}/{settings.bench} "
                   f"({n} workers)", unit="prompt", disable=not progress)
        trees = accepted = 0
        results = pool.map_unordered(lambda a, item: a.capture.remote(*item), todo)
        for t, a, _ in results:
            trees, accepted = trees + t, accepted + a
            done = writer.completed()
            writer.write_manifest({**manifest, "prompts_done": len(done)})
            bar.update(1)
            bar.set_postfix(tau=f"{accepted / max(1, trees):.2f}")
        bar.close()
        writer.finish({**manifest, "prompts_done": len(prompts)}, runs_row(manifest))
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, (OSError, WriterFailed)):
            from capture.run import write_errors
            raise write_errors(out)(cause) from None
        raise CaptureError(f"a capture worker failed: {cause or exc}; the run keeps its complete "
                           "prompts, rerun to resume") from None
    except OSError as exc:
        from capture.run import write_errors
        raise write_errors(out)(exc) from exc
    finally:
        writer.close()
        for a in actors:
            ray.kill(a)
    return summarise(writer, manifest_fields["model"], settings.bench, run, resumed,
                     time.perf_counter() - start, load_seconds)
