"""`gptforge rl`: reinforcement learning from unit tests (GRPO) on a chat model. Each step draws tasks, samples a
group of replies to each on the engine, scores every reply against its task's tests in the sandbox, and steps on
the token-level policy-gradient loss, each reply weighted by its advantage (its reward against its group's).

Every rank runs this loop on its share of the step's tasks; gradients are summed over ranks and the loss divided
by the step's reply tokens on all of them, so N ranks take the step one process would. A reply draws from its own
stream seeded by (seed, step, task, index): a resumed run samples what the whole run would have. Rank 0 logs
(`kind: "rl"` each step, `kind: "tasks"` at each held-out evaluation) and saves.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gptforge.checkpoint import (
    begin_checkpoint,
    end_checkpoint,
    load_checkpoint,
    read_meta,
    resolve_checkpoint,
    restore_training_state,
)
from gptforge.config import Config, config_from_dict, to_dict, to_toml
from gptforge.errors import GptforgeError
from gptforge.eval.tasks import BUILTIN, Reply, check_fits, evaluate_tasks, load_tasks, sample_replies
from gptforge.files import atomic_write
from gptforge.model.gpt import GPT
from gptforge.model.sampling import Sampling
from gptforge.outputs import locked, output_folder
from gptforge.rundir import CONFIG, METRICS, format_duration
from gptforge.runtime import distributed
from gptforge.runtime.device import autocast, resolve_device, resolve_dtype
from gptforge.tasks.builtin import Task, builtin_tasks
from gptforge.tasks.score import score_replies
from gptforge.tokens.chat import chat_template
from gptforge.train.checkpointer import find_resume
from gptforge.train.claim import claim_run_dir
from gptforge.train.metrics import MetricsLog, NullLog
from gptforge.train.optim import build_optimizer, lr_at, set_lr
from gptforge.train.policy import group_advantages, policy_loss, reply_batch, token_logprobs
from gptforge.train.stopping import StopSignal


@dataclass
class RLResult:
    run_dir: Path
    checkpoint: Path
    steps: int
    first_eval: dict | None
    last_eval: dict | None


@dataclass
class StepStats:
    """What a step logs: its replies' mean reward, share solved, parse and define rates, mean length in tokens,
    mean KL to the start and share of tokens clipped; the update's gradient norm and rate; where the time went."""

    reward: float
    pass_rate: float
    parses: float
    defines: float
    reply_tokens: float
    kl: float
    clipped: float
    grad_norm: float
    lr: float
    sample_s: float
    score_s: float
    update_s: float


@dataclass
class _Run:
    cfg: Config
    env: distributed.DistEnv
    model: GPT
    tok: object
    reference: GPT
    optimizer: torch.optim.Optimizer
    dtype: torch.dtype
    tasks: Callable[[int], list[Task]]


def train_rl(cfg: Config, run_dir: str | Path, resume: str | None = None) -> RLResult:
    """RL on `cfg.train.init_from`'s chat model into RUN_DIR (`resume`: auto or a checkpoint); under torchrun each
    process calls this."""
    env, device_name = distributed.init(cfg.train.device, cfg.train.dist_timeout)
    try:
        with StopSignal(env) as stop, contextlib.ExitStack() as cleanup:
            return _train_rl(cfg, output_folder(run_dir), resume, env, resolve_device(device_name), stop, cleanup)
    finally:
        distributed.cleanup()


def _train_rl(cfg, run_dir: Path, resume, env, device, stop: StopSignal, cleanup) -> RLResult:
    t_start = time.perf_counter()
    resume_from = find_resume(run_dir, resume)
    cfg = resolve_rl_config(cfg, env.world_size)
    claim_run_dir(run_dir, resume_from, [cfg.train.init_from])
    run = _build(cfg, env, device)  # a base model or a bad rl.tasks is said before --out is made
    if env.is_main:
        cleanup.enter_context(locked(run_dir, "rl"))
    step, spent = 0, 0.0
    if resume_from:
        meta = restore_training_state(resume_from, run.model, run.optimizer, device, env)
        step, spent = meta["step"], meta.get("seconds", 0.0)
        if step >= cfg.train.max_steps:  # a retried job: its log and checkpoints stay as they are
            distributed.print0(env, f"{run_dir}: complete at step {step}; nothing to train (raise train.max_steps)")
            return RLResult(run_dir, resume_from, step, None, None)
    metrics = cleanup.enter_context(_open_metrics(cfg, run_dir, env, step, resume_from))
    print0 = lambda text: distributed.print0(env, text)  # noqa: E731
    print0(f"rl from {cfg.train.init_from}: {cfg.rl.tasks_per_step} tasks x {cfg.rl.group} replies a step, "
           f"reward {cfg.rl.reward}, {cfg.train.max_steps} steps")  # fmt: skip

    def evaluate() -> dict | None:
        result = held_out(run)
        if result is not None:
            row = result["families"]["all"]
            metrics.write("tasks", step, **row)
            print0(f"step {step}: held-out {_eval_line(row)}")
        return result

    first = last = evaluate() if step == 0 else None
    while step < cfg.train.max_steps:
        stats = rl_step(run, step)
        step += 1
        seconds = spent + time.perf_counter() - t_start
        metrics.write("rl", step, **asdict(stats), time=seconds)
        if step % max(1, cfg.log.every) == 0 or step == cfg.train.max_steps:
            print0(_step_line(step, cfg.train.max_steps, stats))
        out_of_time, signal = _votes(env, cfg.train.time_budget and seconds >= cfg.train.time_budget, stop)
        if out_of_time or signal:
            print0(f"stopping at step {step}: {'out of time' if out_of_time else 'a stop signal'}")
            break
        if step < cfg.train.max_steps and cfg.eval.every and step % cfg.eval.every == 0:
            last = evaluate() or last
        if step < cfg.train.max_steps and cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            _save(run, run_dir, step, spent + time.perf_counter() - t_start)
    last = evaluate() or last
    final = _save(run, run_dir, step, spent + time.perf_counter() - t_start)
    print0(f"done: {step} steps in {format_duration(time.perf_counter() - t_start)}; saved {final}")
    return RLResult(run_dir, final, step, first, last)


def resolve_rl_config(cfg: Config, world: int) -> Config:
    """`cfg` with the model, chat template and infilling of `train.init_from`, the chat model RL starts from."""
    if not cfg.train.init_from:
        raise GptforgeError("rl needs train.init_from: the chat model to start from (--set train.init_from=CKPT)")
    if cfg.train.lora_rank:
        raise GptforgeError("train.lora_rank: rl trains every weight (drop train.lora_rank)")
    if cfg.rl.tasks_per_step < world:
        raise GptforgeError(f"rl.tasks_per_step={cfg.rl.tasks_per_step}: fewer than the {world} processes")
    saved = config_from_dict(read_meta(resolve_checkpoint(cfg.train.init_from))["config"])
    data = dataclasses.replace(cfg.data, chat_template=saved.data.chat_template, fim_rate=saved.data.fim_rate)
    return dataclasses.replace(cfg, model=saved.model, data=data)


def _build(cfg: Config, env: distributed.DistEnv, device: torch.device) -> _Run:
    model, tok, _, _ = load_checkpoint(cfg.train.init_from, device)
    if chat_template(tok) is None:
        raise GptforgeError(f"train.init_from={cfg.train.init_from}: a base model; rl starts from a chat model")
    reference = copy.deepcopy(model).requires_grad_(False)  # the starting policy: its KL is logged, in the loss or not
    dtype = resolve_dtype(cfg.train.dtype, device)
    optimizer = build_optimizer(model, cfg.optim, device.type, dtype=dtype)
    tasks = listed_tasks(cfg)
    if tasks is not None:  # before any evaluation or step: a request past the context is said at once
        check_fits(tok, tasks, cfg.model.block_size, f"rl.tasks {cfg.rl.tasks}")
    return _Run(cfg, env, model, tok, reference, optimizer, dtype, task_source(cfg, tasks))


def listed_tasks(cfg: Config) -> list[Task] | None:
    """rl.tasks' tasks when it lists them: a file's, or those mined from a corpus's training files (None for
    builtin, whose tasks are drawn fresh each step)."""
    return None if cfg.rl.tasks == BUILTIN else load_tasks(cfg.rl.tasks, flag="rl.tasks", split="train")


def task_source(cfg: Config, tasks: list[Task] | None = None) -> Callable[[int], list[Task]]:
    """The tasks of each step: fresh built-in training tasks, or the next ones of `tasks` (rl.tasks' file) in a
    seeded order, a new order each pass; a function of the step alone, so a resumed run draws the same."""
    count, seed = cfg.rl.tasks_per_step, cfg.train.seed
    if cfg.rl.tasks == BUILTIN:
        return lambda step: builtin_tasks("train", count, seed=f"{seed}/{step}")
    tasks = tasks if tasks is not None else listed_tasks(cfg)

    def at(step: int) -> list[Task]:
        out = []
        for position in range(step * count, (step + 1) * count):
            epoch, index = divmod(position, len(tasks))
            order = list(range(len(tasks)))
            random.Random(f"{seed}/{epoch}").shuffle(order)
            out.append(tasks[order[index]])
        return out

    return at


def rl_step(run: _Run, step: int) -> StepStats:
    """Sample, score, update: one step on this rank's share of the step's tasks."""
    cfg, rl, env, model = run.cfg, run.cfg.rl, run.env, run.model
    mine = run.tasks(step)[env.rank :: env.world_size]
    t0 = time.perf_counter()
    rule = Sampling(rl.temperature)
    groups = sample_replies(
        model, run.tok, mine, n=rl.group, rule=rule, seed=(cfg.train.seed, step),
        max_new_tokens=rl.max_new_tokens, dtype=run.dtype, rows=min(64, len(mine) * rl.group),
    )  # fmt: skip
    replies = [r for g in groups for r in g]
    t1 = time.perf_counter()
    scores = score_replies([r.task for r in replies], [r.text for r in replies])
    t2 = time.perf_counter()
    rewards = torch.tensor([s.reward(rl.reward) for s in scores]).view(len(groups), rl.group)
    advantages = group_advantages(rewards, rl.scale).flatten()
    tokens = int(_sum(env, [sum(len(r.ids) for r in replies)])[0])
    lr = set_lr(run.optimizer, lr_at(step, cfg.optim, cfg.train.max_steps))
    # The sampling policy's log probabilities and the start's, computed at the first update, kept for the others.
    olds: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(rl.updates):
        kl, clipped = _accumulate(run, replies, advantages, tokens, olds)
        if env.distributed:
            for p in model.parameters():
                if p.grad is not None:
                    distributed.all_reduce_sum(p.grad, env)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf")))
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    sums = _sum(env, [
        float(rewards.sum()), sum(s.solved for s in scores), sum(s.parses for s in scores),
        sum(s.defines for s in scores), len(scores), kl * len(scores), clipped * len(scores),
    ])  # fmt: skip
    n = sums[4]
    return StepStats(
        reward=sums[0] / n, pass_rate=sums[1] / n, parses=sums[2] / n, defines=sums[3] / n,
        reply_tokens=tokens / n, kl=sums[5] / n, clipped=sums[6] / n, grad_norm=norm, lr=lr,
        sample_s=t1 - t0, score_s=t2 - t1, update_s=t3 - t2,
    )  # fmt: skip


def _accumulate(
    run: _Run,
    replies: list[Reply],
    advantages: torch.Tensor,
    tokens: int,
    olds: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[float, float]:
    """The loss's gradients over `replies`, a micro-batch at a time; (mean KL, share of tokens clipped)."""
    device, size = next(run.model.parameters()).device, run.cfg.rl.micro_batch
    kl = clipped = 0.0
    for i, start in enumerate(range(0, len(replies), size)):
        part = replies[start : start + size]
        batch = reply_batch([r.prompt for r in part], [r.ids for r in part], device)
        with autocast(device, run.dtype):
            logp = token_logprobs(run.model, batch)
            if len(olds) <= i:  # the first update: the weights are still the ones that sampled
                with torch.no_grad():
                    olds.append((logp.detach(), token_logprobs(run.reference, batch)))
        old, ref = olds[i]
        parts = policy_loss(
            logp, old, advantages[start : start + size].to(device), batch.mask,
            tokens=tokens, clip=run.cfg.rl.clip, ref_logp=ref, kl_coef=run.cfg.rl.kl,
        )  # fmt: skip
        parts.loss.backward()
        kl += parts.kl * len(part) / len(replies)
        clipped += parts.clipped * len(part) / len(replies)
    return kl, clipped


def held_out(run: _Run) -> dict | None:
    """pass@1 on rl.eval_tasks held-out built-in tasks, on rank 0 (the others wait); None with none asked for."""
    rl = run.cfg.rl
    result = None
    if rl.eval_tasks and run.env.is_main:
        tasks = builtin_tasks("val", rl.eval_tasks)
        result = evaluate_tasks(
            run.model, run.tok, tasks, n=rl.eval_samples, ks=[1], temperature=rl.eval_temperature,
            max_new_tokens=rl.max_new_tokens, seed=run.cfg.train.seed, dtype=run.dtype,
        )  # fmt: skip
    distributed.barrier(run.env)
    return result


def _sum(env: distributed.DistEnv, values: list[float]) -> list[float]:
    return distributed.all_reduce_sum(torch.tensor(values, dtype=torch.float64), env).tolist()


def _votes(env: distributed.DistEnv, out_of_time: bool, stop: StopSignal) -> tuple[bool, bool]:
    """(rank 0 is out of time, any rank got a stop signal): what every rank does next."""
    votes = _sum(env, [float(bool(out_of_time) and env.is_main), float(stop.received is not None)])
    return votes[0] > 0, votes[1] > 0


def _save(run: _Run, run_dir: Path, step: int, seconds: float) -> Path:
    saving = begin_checkpoint(
        run_dir, step, run.model, run.optimizer, run.cfg, run.tok, extra={"seconds": seconds}, env=run.env
    )
    return end_checkpoint(saving, run.env)


@contextlib.contextmanager
def _open_metrics(cfg: Config, run_dir: Path, env: distributed.DistEnv, step: int, resume_from: Path | None):
    """Rank 0 writes config.toml and logs; a resumed run first says where it resumed (readers drop later rows)."""
    if not env.is_main:
        yield NullLog()
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    restarting = (run_dir / METRICS).is_file()
    atomic_write(run_dir / CONFIG, to_toml(cfg))
    with MetricsLog(run_dir, cfg.log.tensorboard, cfg.log.wandb, to_dict(cfg)) as metrics:
        if restarting:
            metrics.write("resume", step, checkpoint=str(resume_from or ""), changes=[])
        yield metrics


def _eval_line(row: dict) -> str:
    shares = f"parses {row['parses']:.2f} | defines {row['defines']:.2f}"
    return f"pass@1 {row['pass@1']:.4f} | {shares} ({row['tasks']} tasks)"


def _step_line(step: int, steps: int, s: StepStats) -> str:
    return (
        f"step {step:>5}/{steps} | reward {s.reward:.3f} | solved {s.pass_rate:.3f} | parses {s.parses:.2f} | "
        f"length {s.reply_tokens:.0f} | kl {s.kl:.4f} | sample {s.sample_s:.1f}s score {s.score_s:.1f}s "
        f"update {s.update_s:.1f}s"
    )
