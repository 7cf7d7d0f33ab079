"""Shards across workers: Ray actors fed one pending shard at a time, or a job's range of shards.

    python -m decode.record launcher=ray parallel.workers=8      # 8 actors, one model pair each
    python -m decode.record -m launcher=slurm parallel.parts=8   # 8 Slurm jobs per law (Hydra submitit)

`deal` starts `workers` Ray actors, each building its own worker from a factory
(for decode.record: loading a model pair, on one GPU or one CPU core), then hands
each idle actor the next shard until none is left. A shard's result comes back to
the driver, which keeps the one progress bar. When an actor dies (its process was
killed, its node was lost) the shard it held goes back to the queue for another
actor, after `on_dead(shard, owner)` voids the dead writer's claim; an exception
raised *by* the shard's code is not a death and fails the run, as it would in one
process. Stores stay consistent whatever dies: workers write through
`ShardStore.write_pending` (claims, atomic shards, completion markers).

`part_of` is the Slurm side: job `part` of `parts` takes one contiguous range of
the shard list, and the claims keep overlapping or resubmitted jobs apart.

Ray is imported only when a run uses it (the schema and the checks do not need it).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tqdm import tqdm

from specrank.settings.checks import check_choice, check_int, check_real
from specrank.settings.errors import Refusal
from specrank.settings.fields import setting

log = logging.getLogger(__name__)
BACKENDS = ("local", "ray")
KILL_WAIT_S = 30.0  # at most this long for killed actors to be gone before their claims are voided


@dataclass
class ParallelConfig:
    """How a stage spreads its shards: this process (a range of them), or Ray actors."""

    backend: str = setting(
        "local", "local | ray: the work in this process, or dealt to Ray actors (launcher=ray)"
    )
    workers: int = setting(
        1,
        "ray: workers. decode.record and decode.run: actors, each with its own model pair (one "
        "GPU each on CUDA, else one CPU); rerank.train: the CPUs its fit and pass actors share",
    )
    address: str | None = setting(
        None,
        "ray: the cluster to join (auto: the one running on this node; host:6379; "
        "ray://host:10001); null: start a local one with `workers` CPUs (GPUs detected)",
    )
    part: int = setting(
        0,
        "this job's range of shards, 0 .. parts - 1 (decode.record: one job per range, e.g. on "
        "Slurm)",
    )
    parts: int = setting(1, "ranges the shard list is cut into, one per job (1: all shards)")
    max_attempts: int = setting(
        3, "ray: a shard whose actors keep dying fails the run after this many attempts"
    )
    claim_stale_s: float = setting(
        300.0, "seconds after which a shard claim not refreshed is taken over by another worker"
    )


SECTIONS = {"parallel": ParallelConfig}  # shared by decode.record and decode.run


def check_parallel(p: ParallelConfig, device: str) -> None:
    """Every setting, before anything loads; `device` is the models' (model.device)."""
    check_choice("parallel.backend", p.backend, BACKENDS)
    check_int("parallel.workers", p.workers, 1)
    check_int("parallel.parts", p.parts, 1)
    check_int("parallel.part", p.part, 0, p.parts - 1)
    check_int("parallel.max_attempts", p.max_attempts, 1)
    check_real("parallel.claim_stale_s", p.claim_stale_s, 0.0, low_open=True)
    if p.address is not None and (not isinstance(p.address, str) or not p.address):
        raise Refusal(
            f"The 'parallel.address' must be null or a Ray address ('auto', 'host:port', "
            f"'ray://host:port'). Got {p.address!r} instead."
        )
    if p.backend == "ray":
        if p.parts > 1:
            raise Refusal(
                f"parallel.parts={p.parts} with parallel.backend=ray: Ray deals every shard "
                f"itself; use parallel.parts for separate jobs (launcher=slurm), not both"
            )
        if device.startswith("cuda:"):
            raise Refusal(
                f"model.device={device} with parallel.backend=ray: Ray gives each worker its "
                f"own GPU; use model.device=cuda"
            )
        try:
            import ray  # noqa: F401
        except ImportError as err:
            raise ImportError(
                "parallel.backend=ray (launcher=ray) needs the `ray` package: pip install ray"
            ) from err


JOB_LAUNCHERS = ("slurm", "submitit_local")  # conf/launcher options that submit Hydra jobs


def check_launcher(launcher: str | None, multirun: bool) -> None:
    """A job launcher only submits under -m: without it one range would run here, silently."""
    if launcher in JOB_LAUNCHERS and not multirun:
        raise Refusal(
            f"launcher={launcher} submits one job per range of shards (and law): run with -m, "
            f"e.g. python -m decode.record -m launcher={launcher} parallel.parts=8"
        )


def part_of(shard_ids: Sequence[str], part: int, parts: int) -> list[str]:
    """Job `part`'s contiguous range of `shard_ids` (ranges differ in size by at most one)."""
    n = len(shard_ids)
    return list(shard_ids[part * n // parts : (part + 1) * n // parts])


class ShardWorker(Protocol):
    """What a factory builds in each actor: an owner token (its claims) and a shard call."""

    owner: str

    def __call__(self, shard_id: str) -> Any: ...


class ShardActor:
    """The body of one Ray actor: a worker built once, then called shard by shard."""

    def __init__(self, factory: Callable[[], ShardWorker]) -> None:
        self.worker = factory()

    def ready(self) -> tuple[str, Any]:
        """The worker's owner token and what it says about itself (`info()`, if any)."""
        info = getattr(self.worker, "info", None)
        return self.worker.owner, info() if info is not None else None

    def run(self, shard_id: str) -> Any:
        return self.worker(shard_id)


@dataclass
class Dealt:
    results: dict[str, Any]  # shard id -> its worker's result, in the order of the shard list
    infos: list[Any]  # each actor's `ready()` info, in start order
    lost_workers: int  # actors that died during the run
    retried: list[str]  # shards handed to another actor after theirs died


def connect(p: ParallelConfig, gpu: bool, cpus_per_worker: int = 1) -> None:
    """Join the cluster at parallel.address, or start a local one; refuse too few resources."""
    import ray

    if not ray.is_initialized():
        if p.address is None:  # "local": never join a cluster someone else left running here
            ray.init(address="local", num_cpus=p.workers * cpus_per_worker,
                     include_dashboard=False)  # fmt: skip
        else:
            ray.init(address=p.address)
    have = ray.cluster_resources()
    kind = "GPU" if gpu else "CPU"
    need = p.workers * (1 if gpu else cpus_per_worker)
    if have.get(kind, 0) < need:
        where = p.address or "started here"
        each = "model.device=cuda: one GPU" if gpu else f"{cpus_per_worker} CPU"
        raise Refusal(
            f"parallel.workers={p.workers} needs {need} {kind}s in the Ray cluster "
            f"({each} per worker); the cluster ({where}) has {have.get(kind, 0):g}"
        )


def deal(
    shard_ids: Sequence[str],
    factory: Callable[[], ShardWorker],
    p: ParallelConfig,
    gpu: bool,
    sizes: Mapping[str, int] | None = None,
    on_ready: Callable[[list[Any]], None] | None = None,
    on_dead: Callable[[str, str], None] | None = None,
    on_result: Callable[[str, Any], Mapping[str, Any] | None] | None = None,
    progress: bool = True,
    desc: str = "shards",
    unit: str = "shard",
    cpus_per_worker: int = 1,
) -> Dealt:
    """Run `factory()(shard)` for every shard on `p.workers` Ray actors (see the module doc).

    `sizes[shard]` advances the driver's progress bar (default 1 per shard);
    `on_ready(infos)` runs once every actor is up, before any shard is dealt (the
    driver writes its manifest there); `on_dead(shard, owner)` runs for the shard a
    dead actor held; `on_result(shard, result)` may return the bar's postfix. Each actor
    holds `cpus_per_worker` CPUs of the cluster (a worker running that many threads).
    """
    import ray

    connect(p, gpu, cpus_per_worker)
    remote = ray.remote(ShardActor).options(num_cpus=cpus_per_worker, num_gpus=1 if gpu else 0,
                                            max_restarts=0)  # fmt: skip
    actors = [remote.remote(factory) for _ in range(p.workers)]
    # `owners` and `in_flight` are filled in place: the `finally` releases what they hold.
    bar, owners, in_flight = None, {}, {}
    try:
        dealt = _await_actors(actors, owners)
        if on_ready is not None:
            on_ready(dealt.infos)
        sizes = sizes or {}
        bar = tqdm(total=sum(sizes.get(s, 1) for s in shard_ids), desc=desc, unit=unit,
                   disable=not progress)  # fmt: skip
        deck = _Deck(deque(shard_ids), dict.fromkeys(shard_ids, 0), list(actors), set(actors))
        while deck.queue or in_flight:
            _hand_out(deck, in_flight)
            (ref,), _ = ray.wait(list(in_flight), num_returns=1)
            actor, sid = in_flight.pop(ref)
            if _collect(ref, actor, sid, dealt, deck, owners, p, on_dead):
                deck.idle.append(actor)
                postfix = on_result(sid, dealt.results[sid]) if on_result is not None else None
                if postfix:
                    bar.set_postfix(postfix, refresh=False)
                bar.update(sizes.get(sid, 1))
        dealt.results = {sid: dealt.results[sid] for sid in shard_ids}
        return dealt
    finally:  # done, or failing: no actor outlives the call, and none keeps a claim
        if bar is not None:
            bar.close()
        for a in actors:
            ray.kill(a, no_restart=True)
        if in_flight:
            # ray.kill returns before the process is gone: a task still in flight could yet
            # write its claim after the driver voids it. Its ref resolves (ActorDiedError)
            # once the actor is dead, so wait for that first.
            ray.wait(list(in_flight), num_returns=len(in_flight), timeout=KILL_WAIT_S)
        if on_dead is not None:
            for actor, sid in in_flight.values():
                on_dead(sid, owners[actor])


@dataclass
class _Deck:
    """The driver's dealing state: shards left, hand-outs per shard, idle and live actors."""

    queue: deque[str]
    attempts: dict[str, int]
    idle: list[Any]
    live: set[Any]


def _await_actors(actors: list[Any], owners: dict[Any, str]) -> Dealt:
    """Wait for every actor to be up, filling `owners`; an empty `Dealt` with their infos."""
    import ray

    # Every actor up first: a worker that cannot load fails the run with its own error.
    ready = ray.get([a.ready.remote() for a in actors])
    owners.update({a: owner for a, (owner, _) in zip(actors, ready, strict=True)})
    return Dealt({}, [info for _, info in ready], 0, [])


def _hand_out(deck: _Deck, in_flight: dict[Any, tuple[Any, str]]) -> None:
    """Give each idle actor the next shard in the queue, while both last."""
    while deck.queue and deck.idle:
        actor, sid = deck.idle.pop(), deck.queue.popleft()
        deck.attempts[sid] += 1
        in_flight[actor.run.remote(sid)] = (actor, sid)


def _collect(
    ref: Any,
    actor: Any,
    sid: str,
    dealt: Dealt,
    deck: _Deck,
    owners: Mapping[Any, str],
    p: ParallelConfig,
    on_dead: Callable[[str, str], None] | None,
) -> bool:
    """Store shard `sid`'s result (True), or requeue it if its actor died (False).

    Raises when the shard has used up its attempts or when no actor is left.
    """
    import ray
    from ray.exceptions import ActorDiedError, RayActorError

    try:
        dealt.results[sid] = ray.get(ref)
    except RayActorError as err:  # the actor is gone (not an error of the shard's code)
        dealt.lost_workers += 1
        deck.live.discard(actor)
        ray.kill(actor, no_restart=True)
        if isinstance(err, ActorDiedError) and on_dead is not None:
            on_dead(sid, owners[actor])  # known dead: its claim is void now
        if deck.attempts[sid] >= p.max_attempts:
            raise RuntimeError(
                f"shard {sid}: {deck.attempts[sid]} workers died on it (parallel.max_attempts="
                f"{p.max_attempts}); last: {err}"
            ) from err
        if not deck.live:
            left = sorted({sid, *deck.queue} - set(dealt.results))
            raise RuntimeError(
                f"every Ray worker died; {len(left)} shard(s) not done ({left[:5]}...); "
                f"rerun the same command to finish them (finished shards are kept)"
            ) from err
        log.warning("a Ray worker died on shard %s (%s); dealing it again", sid, err)
        dealt.retried.append(sid)
        deck.queue.appendleft(sid)
        return False
    return True
