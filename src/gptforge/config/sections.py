"""The run configuration's sections: typed dataclasses whose fields' docstrings are their documentation."""

from __future__ import annotations

from dataclasses import dataclass, field

from gptforge.model.gpt import GPTConfig


@dataclass
class DataConfig:
    path: str = ""
    """Folder written by `gptforge prepare` (manifest.json + shards); `--data` sets it."""
    mix: list[str] = field(default_factory=list)
    """Instead of `path`: several prepared folders trained on at once, as FOLDER=WEIGHT entries (TOML: a list of
    strings; --set: comma-separated). Each folder's share of the training windows is its weight over their sum,
    in every stretch of training; its val split is scored on its own (val `loss/NAME`, `bpb/NAME`)."""
    shuffle: bool = True
    """Serve training windows in a seeded random order each epoch (else in corpus order)."""
    fim_rate: float = 0.0
    """Fill-in-the-middle: the share of training documents rearranged as prefix/suffix/middle with sentinel tokens
    as batches are read (StarCoder: 0.5), so the model learns to infill (`sample --suffix`). Validation stays
    left to right."""
    fim_spm_rate: float = 0.5
    """Of the rearranged documents, the share in suffix-prefix-middle order (the rest prefix-suffix-middle)."""
    chat_template: str = ""
    """chatml for a model that speaks in conversations (its tokenizer gains <|im_start|> and <|im_end|>); set by
    training on a folder of `prepare --chat`, or kept from train.init_from's model; empty: a base model."""


AUTO_PROMPT = "auto"  # eval.prompt: chosen by the data's main language
SCHEDULES = ("cosine", "wsd", "constant")  # optim.lr_at computes each
PARALLEL = ("ddp", "fsdp")  # how train.parallel spreads a model over the processes


@dataclass
class OptimConfig:
    lr: float = 6e-4
    """Peak learning rate, reached at the end of warm-up."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio (GPT-3: 10%)."""
    warmup_steps: int = 715
    """Linear warm-up steps from lr/warmup_steps to lr."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices and embeddings only (not biases or LayerNorm gains)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2 (GPT-3: 0.95)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables); the pre-clip norm is logged."""
    schedule: str = "cosine"
    """cosine (warm-up, cosine decay to min), wsd (warm-up, stable, linear decay to min), or constant."""
    decay_fraction: float = 0.2
    """For wsd: the share of the steps spent decaying at the end."""
    optimizer: str = "adamw"
    """adamw (GPT-3), or muon: Muon for the blocks' 2-D matrices, AdamW (lr, betas, eps above) for embeddings,
    lm_head, gains and biases."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (the schedule scales it with lr)."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum."""


@dataclass
class TrainConfig:
    micro_batch: int = 64
    """Sequences per forward/backward pass per process (B)."""
    batch_tokens: int = 524_288
    """Tokens per optimizer step across all processes; gradient accumulation makes up the difference."""
    max_steps: int = 19_073
    """Optimizer steps; the LR schedule spans exactly these."""
    time_budget: float = 0.0
    """Wall-clock seconds for the whole run, evaluations included (0: none), kept to within about one step: the step
    count is planned from the steps' pace, and again as it drifts, so that the schedule ends at the last step (a
    re-plan bends the decay, never raising the learning rate); on a slow host evaluations score fewer tokens (the
    first and the final one: a quarter of it at most); a resumed run counts its earlier commands' seconds."""
    seed: int = 1337
    """Seed for initialization and data order."""
    device: str = "auto"
    """auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps."""
    dtype: str = "auto"
    """auto, float32, bfloat16 or float16: autocast dtype; auto = bf16 on GPUs and on CPUs where it measures faster."""
    compile: bool = False
    """torch.compile the model for training (evaluation and sampling keep working)."""
    zero: bool = False
    """Shard AdamW's state across processes (ZeroRedundancyOptimizer) for models whose optimizer does not fit."""
    parallel: str = "ddp"
    """ddp (a whole model per process) or fsdp (FSDP2: parameters, gradients and optimizer state sharded across
    the processes, each block gathered for its forward and backward) for models that do not fit one device."""
    reshard_after_forward: bool = True
    """fsdp: free each block's gathered parameters after its forward (gathered again for backward), saving memory
    for one more all-gather per block."""
    dist_timeout: float = 300.0
    """Seconds a rank waits for the others in a collective before the run fails (PyTorch waits 1800): 5 minutes
    covers the others waiting while rank 0 writes a checkpoint; raise it if `checkpoint.push` takes longer."""
    batch_ramp_tokens: int = 0
    """GPT-3's batch ramp: grow the batch linearly from one micro-batch per process to batch_tokens over this
    many tokens (0: full batch from the start)."""
    max_skips: int = 10
    """Stop after this many steps in a row with a non-finite loss or gradient (each is skipped, not applied)."""
    threads: int = 0
    """CPU threads per process (0: torch's count, one per core). On busy cores fewer can be faster: a run whose
    threads barely outrun one thread at matmuls, or measure far below an idle core's speed, says so."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU (0: from the GPU table, or a matmul probe on CPU)."""
    init_from: str = ""
    """Checkpoint whose weights start the run (e.g. from `gptforge import`); its model section replaces ours."""
    lora_rank: int = 0
    """Train low-rank adapters of this rank on lora_targets, every base weight frozen (0: train every weight)."""
    lora_alpha: float = 16.0
    """LoRA's scale: each adapter's update is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on each adapted layer's input to its adapter."""
    lora_targets: str = "attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj"
    """Comma-separated linear layers that get adapters (model/lora.py's TARGETS): attention's fused qkv and output,
    the MLP's two projections."""


@dataclass
class EvalConfig:
    every: int = 250
    """Validate every N steps (and at the first and last step); 0: only at the start and the end."""
    tokens: int = 1_048_576
    """Validation tokens per evaluation: windows spread evenly over the split (capped by its size), whatever the
    batch size; `gptforge eval` scores as many by default."""
    hellaswag: str = ""
    """HellaSwag jsonl[.gz] (or hf:Rowan/hellaswag) scored at every evaluation (empty: none)."""
    hellaswag_limit: int = 0
    """HellaSwag examples per evaluation (0: all 10,042)."""
    code: int = 0
    """Code measures at every evaluation on the validation split (0: none): N hidden lines and N hidden 3-line
    spans written back (with the suffix for a FIM model, and from the prefix alone), and up to N sampled function
    bodies parsed; the first process scores them."""
    prompt: str = "auto"
    """Prompt for the text sample printed at each evaluation; auto: one in the data's main language (`def
    fibonacci(n):` for Python, by prepare's count of documents per language), or a fresh document for prose and
    languages without one (train/setup.py's PROMPTS); empty: a fresh document."""
    sample_tokens: int = 64
    """Tokens to generate for that sample (0: no samples)."""


@dataclass
class CheckpointConfig:
    every: int = 5000
    """Save a checkpoint every N steps (0: only at the end); the last step always saves."""
    keep_last: int = 0
    """Keep only the newest N checkpoints (0: keep all)."""
    milestone_every: int = 0
    """Never delete checkpoints whose step is a multiple of this (0: no milestones)."""
    push: str = ""
    """Git repository (e.g. a Hugging Face model repo) that gets each checkpoint, exported, as a commit."""
    push_branch: str = ""
    """Branch for `push` (default: the run folder's name): one branch per run."""
    async_save: bool = False
    """fsdp: write the periodic checkpoints' shards on a thread while training goes on (each is put in place once
    written, at the latest by the next save); the last one, and one on a stop signal, are written before exiting."""


@dataclass
class LogConfig:
    every: int = 1
    """Print a console line every N steps (every step is written to metrics.jsonl)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tensorboard (needs `pip install tensorboard`)."""
    wandb: str = ""
    """Also log to this W&B project (WANDB_MODE=offline works without a network; needs `pip install wandb`)."""


@dataclass
class RLConfig:
    tasks: str = "builtin"
    """`gptforge rl`'s training tasks: builtin (the built-in families' training split, fresh tasks each step),
    doctests:SOURCE (mined from the doctests of a `prepare` source's training files) or a JSONL file of tasks
    (request, entry_point, tests); listed tasks are taken in a seeded order each pass."""
    tasks_per_step: int = 7
    """Tasks a step (all processes together), each answered by `group` replies."""
    group: int = 8
    """Replies sampled per task; a reply's advantage is its reward less its group's mean."""
    temperature: float = 1.0
    """Sampling temperature of the replies."""
    max_new_tokens: int = 128
    """A reply's length limit in tokens (it ends sooner at the end of its turn)."""
    reward: str = "pass"
    """pass: 1 when every test passes, else 0; share: the share of its tests a reply passes (a denser signal for a
    weak model). A reply the sandbox stopped (a timeout, memory, a refused operation) earns 0 either way."""
    scale: bool = True
    """Divide advantages by their group's standard deviation (GRPO); false keeps reward - mean (Dr. GRPO)."""
    kl: float = 0.0
    """Weight of a KL term (k3 estimate) to the starting policy in the loss (0: none; the KL is logged either way,
    from a frozen copy of the starting weights)."""
    updates: int = 1
    """Optimizer steps on each batch of replies; past the first, the probability ratio to the sampling policy is
    clipped (PPO)."""
    clip: float = 0.2
    """PPO's clip range for that ratio: [1 - clip, 1 + clip]."""
    micro_batch: int = 16
    """Replies per forward/backward pass of the update."""
    eval_tasks: int = 35
    """Held-out built-in tasks scored at each evaluation (the start, every eval.every steps, the end)."""
    eval_samples: int = 1
    """Replies per held-out task (pass@1 is the unbiased estimate over them)."""
    eval_temperature: float = 0.0
    """Their sampling temperature (0: greedy, the model's own best answer)."""


@dataclass
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    rl: RLConfig = field(default_factory=RLConfig)
