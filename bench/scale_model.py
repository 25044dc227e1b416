"""A scale model on paper: predicted time of one weight update for 8B-1T models over K nodes of 8 GPUs, built
from the link figures measured in bench/results/ and stated network figures, checked against the 1-2 GPU
measurements and set beside published figures of other systems. Prints one JSON object; --markdown prints the
tables docs/scaling.md embeds. Standard library only.

    python bench/scale_model.py [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9  # decimal, as every bench/results file reports GB/s

# ---- stated figures (not measured here) -------------------------------------------------------------------------
GPUS_PER_NODE = 8
NIC_GBPS = 400  # Gb/s per GPU: one 400 Gb/s ConnectX-7 per GPU (DGX/HGX H100 and H200); the TransferEngine paper
# (arXiv 2510.27656) reaches this 400 Gb/s per GPU on ConnectX-7 and on AWS EFA
NET_EFFICIENCY = 0.8  # assumed share of line rate a bulk NCCL/RDMA transfer sustains; times scale with 1/this
GPU_MEMORY = 141 * GB  # H200 HBM3e (NVIDIA's figure)
WEIGHT_SHARE = 0.6  # an inference replica keeps at most this share of each GPU for weights (the rest: KV cache)
TRAIN_BYTES_PER_PARAM = 16  # bf16 weights + grads, fp32 master + two Adam moments, fully sharded
TRAIN_SHARE = 0.8  # share of trainer GPU memory for that state (the rest: activations)
MODELS = [("8B", 8e9, 2), ("70B", 70e9, 2), ("671B", 671e9, 2), ("1T", 1e12, 2), ("671B", 671e9, 1), ("1T", 1e12, 1)]
NODES = [1, 2, 4, 8, 16, 32, 64, 128]


# ---- measured figures, pulled from bench/results by key ----------------------------------------------------------
def load(name: str) -> dict:
    path = RESULTS / name
    if not path.exists():
        sys.exit(f"scale_model: {path} is missing; it is written by the benchmark named in docs/scaling.md")
    return json.loads(path.read_text())


def pick(doc: dict, name: str, *keys):
    value = doc
    for k in keys:
        try:
            value = value[k]
        except (KeyError, IndexError, TypeError):
            sys.exit(f"scale_model: bench/results/{name} has no {'.'.join(map(str, keys))} (stopped at {k!r})")
    return value


def steady(doc: dict, name: str, mode: str, phase: str) -> float:
    """Median of cycles 2.. of one phase: the first cycle pays CUDA, allocator and NCCL set-up."""
    return statistics.median(pick(c, name, "phases_s", phase) for c in pick(doc, name, mode, "cycles")[1:])


def measured() -> dict:
    """Every input with the file and key it came from."""
    ipc, nccl = load("transfer-h200-cuda_ipc.json"), load("transfer-h200x2-nccl.json")
    h100 = load("gpu-cycle-h100-colocated.json")
    prof = pick(h100, "gpu-cycle-h100-colocated.json", "colocated", "steady", "transfer_profile_ms")
    lib_fixed_ms = sum(prof[k] for k in ("connect", "receiver_map", "receiver_release", "receiver_verify"))
    h100_cycle = "gpu-cycle-h100-colocated.json"
    q, qname = load("fp8-quantize-h200.json"), "fp8-quantize-h200.json"
    transfer_ms = pick(h100, h100_cycle, "colocated", "steady", "transfer_ms")
    return {
        "d2d_copy_GB/s": (pick(ipc, "transfer-h200-cuda_ipc.json", "limits", "d2d_copy"),
                          "transfer-h200-cuda_ipc.json: limits.d2d_copy (H200, 4 GiB device copy)"),
        "copy_vs_d2d": (pick(h100, h100_cycle, "colocated", "steady", "copy_vs_d2d"),
                        f"{h100_cycle}: colocated.steady.copy_vs_d2d (the receiver's one copy, on the GPU stream)"),
        "nvlink_nccl_GB/s": (pick(nccl, "transfer-h200x2-nccl.json", "limits", "nccl_broadcast"),
                             "transfer-h200x2-nccl.json: limits.nccl_broadcast (raw NCCL broadcast, H200 x2 NV18)"),
        "transfer_fixed_s": ((transfer_ms - prof["receiver_copy"]) / 1e3,
                             f"{h100_cycle}: colocated.steady transfer_ms - transfer_profile_ms.receiver_copy"),
        "library_fixed_s": (lib_fixed_ms / 1e3, f"{h100_cycle}: transfer_profile_ms connect + receiver_map + "
                            "receiver_release + receiver_verify (the transfer library alone, no RPC)"),
        "fp8_quantize_GB/s": (pick(q, qname, "bf16_bytes") / pick(q, qname, "quantize_seconds") / GB,
                              f"{qname}: bf16_bytes / quantize_seconds (bf16 in, FP8 + block scales out, H200)"),
        "prepare_commit_s": (steady(h100, h100_cycle, "colocated", "prepare")
                             + steady(h100, h100_cycle, "colocated", "commit"),
                             f"{h100_cycle}: median prepare + median commit, cycles 2-5"),
    }


@dataclass(frozen=True)
class Links:
    copy: float  # B/s, one device-to-device copy as the receiver achieves it
    nvlink: float  # B/s, NCCL broadcast between GPUs of one node
    nic: float  # B/s, one GPU's NIC, achievable
    fixed: float  # s per update that does not grow with bytes: transfer control path + prepare + commit
    quantize: float  # B/s of bf16 weights quantized to block FP8 on one GPU (the trainer's, before sending)

    @property
    def node(self) -> float:
        return GPUS_PER_NODE * self.nic


def links_from(inputs: dict) -> Links:
    v = {k: val for k, (val, _) in inputs.items()}
    return Links(copy=v["d2d_copy_GB/s"] * v["copy_vs_d2d"] * GB, nvlink=v["nvlink_nccl_GB/s"] * GB,
                 nic=NIC_GBPS / 8 * GB * NET_EFFICIENCY, fixed=v["transfer_fixed_s"] + v["prepare_commit_s"],
                 quantize=v["fp8_quantize_GB/s"] * GB)


def quantize_s(params: float, gpus: int, ln: Links) -> float:
    """BF16 training, FP8 serving: each of `gpus` GPUs quantizes its share of the bf16 weights (2 bytes a parameter)
    before it sends, one kernel per bucket; counted before the transfer, not overlapped with it."""
    return 2 * params / gpus / ln.quantize


# ---- the model: pure functions of bytes, layout and links ---------------------------------------------------------
def replica_gpus(nbytes: float) -> int:
    """GPUs of one inference replica: the smallest power of two that holds the weights within WEIGHT_SHARE."""
    g = 1
    while nbytes / g > WEIGHT_SHARE * GPU_MEMORY:
        g *= 2
    return g


def gather_to_rank0(nbytes: float, trainer_gpus: int, ln: Links) -> float:
    """Rank 0 receives every shard: its node's over NVLink, the others through its one NIC, both at once."""
    local = min(GPUS_PER_NODE, trainer_gpus)
    return max(nbytes * (local - 1) / trainer_gpus / ln.nvlink, nbytes * (trainer_gpus - local) / trainer_gpus / ln.nic)


def broadcast_from_rank0(nbytes: float, across_nodes: bool, root_node_receives: bool, ln: Links) -> float:
    """A pipelined ring broadcast runs at its slowest hop. Across nodes a ring through the root's node uses all its
    NICs when the root's neighbours are receivers (colocated); a root alone on its node has one NIC."""
    if not across_nodes:
        return nbytes / ln.nvlink
    return nbytes / min(ln.nvlink, ln.node if root_node_receives else ln.nic)


def rank0(nbytes: float, trainer_gpus: int, across_nodes: bool, root_node_receives: bool, ln: Links) -> dict:
    """The rank-0 design (rlsync's publisher until routes; still what several systems do): gather to rank 0, then
    one sender broadcasts the whole model to every engine GPU. Kept to set published rank-0 systems beside."""
    return {"gather_s": gather_to_rank0(nbytes, trainer_gpus, ln),
            "broadcast_s": broadcast_from_rank0(nbytes, across_nodes, root_node_receives, ln)}


def colocated_sharded(nbytes: float, nodes: int, g_r: int, ln: Links) -> dict:
    """Every GPU holds its engine shard (nbytes / g_r). The copy is rlsync's one-copy CUDA IPC path; the reshard is
    what gets that shard out of the trainer's FSDP shards, spread over all GPUs: 7/N of it over NVLink, the rest
    through the GPU's own NIC, at once."""
    n, shard = nodes * GPUS_PER_NODE, nbytes / g_r
    return {"reshard_s": max(shard * (GPUS_PER_NODE - 1) / n / ln.nvlink, shard * (n - GPUS_PER_NODE) / n / ln.nic),
            "copy_s": shard / ln.copy}


def async_sharded(nbytes: float, trainer_nodes: int, rollout_nodes: int, g_r: int, ln: Links) -> dict:
    """Every trainer node sends its 1/trainer_nodes of the weights; every rollout node needs nbytes / (nodes per
    replica), relayed node to node (pipelined, so the time does not grow with the number of rollout nodes); a
    replica smaller than a node fills its GPUs over NVLink while the bytes arrive."""
    if rollout_nodes == 0:  # one node split in two halves: NVLink only
        return {"network_s": 0.0, "fanout_s": nbytes / g_r / ln.nvlink}
    per_node = nbytes / max(1, g_r // GPUS_PER_NODE)
    fanout = nbytes / g_r * (1 - g_r / GPUS_PER_NODE) / ln.nvlink if g_r < GPUS_PER_NODE else 0.0
    return {"network_s": max(nbytes / trainer_nodes, per_node) / ln.node, "fanout_s": fanout}


def async_routed(nbytes: float, trainer_gpus: int, rollout_gpus: int, g_r: int, ln: Links) -> dict:
    """rlsync today (routes, rlsync.transfer.routed): every trainer GPU sends its own pieces point to point to
    every engine GPU that loads them, all replicas at once, no relay. A trainer GPU holds nbytes / trainer_gpus
    and sends it to each of the R = rollout_gpus / g_r replicas; an engine GPU receives its shard nbytes / g_r.
    Each GPU's own link is the limit: NVLink within one node (the one-node split), its NIC across nodes."""
    replicas = rollout_gpus / g_r
    link = ln.nvlink if rollout_gpus + trainer_gpus <= GPUS_PER_NODE else ln.nic
    return {"send_s": nbytes / trainer_gpus * replicas / link, "receive_s": nbytes / g_r / link}


def trainer_fits(params: float, gpus: int) -> bool:
    return TRAIN_BYTES_PER_PARAM * params <= TRAIN_SHARE * GPU_MEMORY * gpus


def predictions(ln: Links) -> list[dict]:
    rows = []
    for name, params, bpp in MODELS:
        nbytes = params * bpp
        g_r = replica_gpus(nbytes)
        for k in NODES:
            gpus = k * GPUS_PER_NODE
            # async: half the nodes train, half generate (one node: 4 GPUs each)
            half = gpus // 2
            t_nodes, r_nodes = (k // 2, k // 2) if k > 1 else (1, 0)
            co_fits = trainer_fits(params, gpus) and gpus >= g_r
            async_fits = trainer_fits(params, half) and half >= g_r
            modes = {
                "colocated-sharded": (colocated_sharded(nbytes, k, g_r, ln), co_fits),
                "async-routed": (async_routed(nbytes, half, half, g_r, ln), async_fits),
                "async-sharded": (async_sharded(nbytes, t_nodes, r_nodes, g_r, ln), async_fits),
            }
            for mode, (terms, fits) in modes.items():
                data = max(terms.values()) if mode in ("async-sharded", "async-routed") else sum(terms.values())
                if not fits:  # the trainer's state or one inference replica does not fit in these GPUs
                    continue
                quantize = 0.0
                if bpp == 1:  # the trainer holds bf16: its GPUs quantize their own shards first
                    quantize = quantize_s(params, gpus if mode == "colocated-sharded" else half, ln)
                    terms = {"quantize_s": quantize, **terms}
                    data += quantize
                rows.append({"model": name, "params": params, "dtype": "bf16" if bpp == 2 else "fp8",
                             "bytes": nbytes, "nodes": k, "gpus": gpus, "replica_gpus": g_r, "mode": mode,
                             "terms_s": {t: round(v, 4) for t, v in terms.items()}, "fixed_s": round(ln.fixed, 4),
                             "seconds": round(data + ln.fixed, 4)})
                if mode == "colocated-sharded":  # the brief's floor: the copy alone, engine layout already in place
                    # (in fp8: each GPU quantizes its bf16 engine shard, 2 bytes a parameter, then copies it)
                    engine_quantize = quantize_s(params, g_r, ln) if bpp == 1 else 0.0
                    rows[-1]["copy_only_s"] = round(terms["copy_s"] + engine_quantize + ln.fixed, 4)
    return rows


# ---- the check: the same formulas against what was measured at 1-2 GPUs ------------------------------------------
def check(inputs: dict, ln: Links) -> list[dict]:
    v = {k: val for k, (val, _) in inputs.items()}
    ipc, nccl = load("transfer-h200-cuda_ipc.json"), load("transfer-h200x2-nccl.json")
    co, dis = load("gpu-cycle-h200-colocated.json"), load("gpu-cycle-h200x2-disaggregated.json")
    cpu = load("transfer-cpu.json")

    def channel(doc, name, backend, mode, layout):  # not held: each transfer maps the sender's memory anew
        for c in pick(doc, name, "channels"):
            if (c["backend"], c["mode"], c["layout"], c.get("held", False)) == (backend, mode, layout, False):
                return c["seconds"]
        sys.exit(f"scale_model: bench/results/{name} has no {backend} {mode} {layout} channel")

    co_bytes = pick(co, "gpu-cycle-h200-colocated.json", "checkpoint_bytes")
    co_copy = pick(co, "gpu-cycle-h200-colocated.json", "limits", "d2d_copy_GB/s") * GB * v["copy_vs_d2d"]
    dis_bytes = pick(dis, "gpu-cycle-h200x2-disaggregated.json", "checkpoint_bytes")
    fixed_t, fixed_pc = v["transfer_fixed_s"], v["prepare_commit_s"]
    co_name, dis_name = "gpu-cycle-h200-colocated.json", "gpu-cycle-h200x2-disaggregated.json"
    rows = [
        ("qwen3-4b, 8.82 GB, cuda_ipc one-copy flat, H200 (transfer library alone)",
         pick(ipc, "transfer-h200-cuda_ipc.json", "bytes") / ln.copy + v["library_fixed_s"],
         channel(ipc, "transfer-h200-cuda_ipc.json", "cuda_ipc", "pull", "flat")),  # the one-copy pull
        ("qwen3-4b, 8.82 GB, nccl flat, H200 x2 (transfer library alone)",
         pick(nccl, "transfer-h200x2-nccl.json", "bytes") / ln.nvlink + v["library_fixed_s"],
         channel(nccl, "transfer-h200x2-nccl.json", "nccl", "staged", "flat")),
        ("qwen3-1.7b, 3.44 GB, colocated on one H200: transfer phase",
         co_bytes / co_copy + fixed_t, steady(co, co_name, "colocated", "transfer")),
        ("qwen3-1.7b, 3.44 GB, colocated on one H200: prepare + transfer + commit",
         co_bytes / co_copy + fixed_t + fixed_pc,
         sum(steady(co, co_name, "colocated", p) for p in ("prepare", "transfer", "commit"))),
        ("qwen3-1.7b, 3.44 GB, disaggregated H200 x2 (NCCL): transfer phase",
         dis_bytes / ln.nvlink + fixed_t, steady(dis, dis_name, "disaggregated", "transfer")),
        ("qwen3-1.7b, 3.44 GB, disaggregated H200 x2 (NCCL): prepare + transfer + commit",
         dis_bytes / ln.nvlink + fixed_t + fixed_pc,
         sum(steady(dis, dis_name, "disaggregated", p) for p in ("prepare", "transfer", "commit"))),
        ("qwen3-4b, 8.82 GB, shm one-copy, 2-core CPU (memcpy as the copy rate)",
         pick(cpu, "transfer-cpu.json", "bytes") / (pick(cpu, "transfer-cpu.json", "limits", "memcpy_1_thread") * GB),
         channel(cpu, "transfer-cpu.json", "shm", "one_copy", "arena")),
    ]
    return [{"config": c, "predicted_s": round(p, 5), "measured_s": round(m, 5), "ratio": round(p / m, 3)}
            for c, p, m in rows]


# ---- published figures of other systems (typed from their sources; dates are publication dates) --------------------
PUBLISHED = [
    {"system": "MoonshotAI checkpoint-engine (broadcast)", "date": "2025-09-10", "model": "Kimi-K2-Instruct, FP8",
     "bytes": None, "setup": "256x H20, 16 vLLM instances of TP16; weights start in host memory",
     "seconds": 16.04, "mode": None, "url": "https://github.com/MoonshotAI/checkpoint-engine#benchmark",
     "note": "README table; 14.36 s on 16x H20, 6.22 s for Qwen3-235B BF16 on 8x H800; headline: 1T on "
             "thousands of GPUs in about 20 s. Includes H2D and the engine's reload"},
    {"system": "Perplexity (RDMA WRITE, point to point)", "date": "2025-09-24", "model": "Kimi-K2 1T, BF16 train "
     "-> FP8 inference", "bytes": 1.0e12, "setup": "256 training GPUs -> 128 inference GPUs, RDMA",
     "seconds": 1.3, "mode": "async-sharded", "trainer_nodes": 32, "rollout_nodes": 16, "replica_gpus": 16,
     "quantized_params": 1e12,  # bf16 on the trainer, quantized before sending
     "url": "https://research.perplexity.ai/articles/weight-transfer-for-rl-post-training-in-under-2-seconds",
     "note": "also arXiv 2510.27656. Replica size not published: 16 GPUs assumed here (8 GPUs: 3.1 s; 32: 0.8 s)"},
    {"system": "SGLang + miles, NCCL broadcast", "date": "2026-04-29", "model": "Kimi-K2 FP8 (~1 TB)",
     "bytes": 1.0e12, "setup": "H100 hosts, InfiniBand; train 32 nodes, inference TP32 on 32 nodes",
     "seconds": 53.3, "mode": "async-rank0", "trainer_nodes": 32,
     "url": "https://www.lmsys.org/blog/2026-04-29-p2p-update/",
     "note": "pause to resume; one head rank per pipeline stage (PP8) gathers and broadcasts, not one rank 0"},
    {"system": "SGLang + miles, RDMA P2P", "date": "2026-04-29", "model": "Kimi-K2 FP8 (~1 TB)", "bytes": 1.0e12,
     "setup": "as above", "seconds": 7.2, "mode": "async-sharded", "trainer_nodes": 32, "rollout_nodes": 32,
     "replica_gpus": 32, "url": "https://www.lmsys.org/blog/2026-04-29-p2p-update/",
     "note": "every trainer rank sends from a CPU replica; same post: Qwen3-235B 10.8 s -> 3.2 s on 8 nodes"},
    {"system": "verl checkpoint engine, NCCL", "date": "2026-01-06", "model": "Qwen3-30B-A3B-Base, BF16",
     "bytes": 61e9, "setup": "4x8 H100, ConnectX-7 400 Gb/s IB; FSDP trainer on 2 GPUs -> 30 rollout GPUs",
     "seconds": 7.0, "mode": "async-rank0", "trainer_gpus": 2, "root_node_receives": True,
     "url": "https://github.com/volcengine/verl/blob/main/verl/checkpoint_engine/README.md",
     "note": "8.25 GB/s reported; receivers only receive (no copy into vLLM/SGLang)"},
    {"system": "NeMo-RL refit (CUDA IPC, colocated)", "date": "2025-08-12", "model": "DeepSeek-V3 671B",
     "bytes": None, "setup": "train EP64 PP8 -> generation TP64; GPU count not stated", "seconds": 47.2,
     "mode": None, "url": "https://nvidia-nemo.github.io/blog/2025/08/12/nemo-rl-refit-performance",
     "note": "692.5 s before the work; their own speed-of-light estimate: 3.3 s"},
    {"system": "slime (CUDA IPC, colocated)", "date": "2025-08-27", "model": "Qwen3-30B-A3B, BF16", "bytes": 61e9,
     "setup": "8x H100, one node", "seconds": 7.0, "mode": "colocated-sharded", "nodes": 1, "replica_gpus": 8,
     "url": "https://hebiao064.github.io/rl-weight-sync",
     "note": "60 s -> 7 s; includes SGLang's load_weights (rlsync's hf engine commits by a pointer swap)"},
    {"system": "checkpoint-engine 0.4.2, measured here", "date": "2026-11-22", "model": "Qwen3-4B-shaped, BF16",
     "bytes": 8.82e9, "setup": "one H200, CUDA IPC from pinned host memory", "seconds": 0.49, "mode": None,
     "url": None, "note": "the project's environment facts (not a bench/results file); rlsync's one-copy path, "
     "same bytes, same GPU: 5.3 ms"},
]


def published(ln: Links) -> list[dict]:
    out = []
    for p in PUBLISHED:
        row = {k: v for k, v in p.items() if k not in ("trainer_nodes", "rollout_nodes", "replica_gpus", "nodes",
                                                          "trainer_gpus", "root_node_receives", "quantized_params")}
        mode, b = p["mode"], p["bytes"]
        if mode == "async-sharded":
            trainer_gpus = p["trainer_nodes"] * GPUS_PER_NODE
            quantize = quantize_s(p["quantized_params"], trainer_gpus, ln) if "quantized_params" in p else 0.0
            if quantize:
                row["quantize_s"] = round(quantize, 4)
            terms = async_sharded(b, p["trainer_nodes"], p["rollout_nodes"], p["replica_gpus"], ln)
            row["model_s"] = max(terms.values()) + quantize + ln.fixed
            routes = async_routed(b, trainer_gpus, p["rollout_nodes"] * GPUS_PER_NODE, p["replica_gpus"], ln)
            row["rlsync_routes_s"] = round(max(routes.values()) + quantize + ln.fixed, 4)  # rlsync today, same setup
        elif mode == "async-rank0":
            gpus = p.get("trainer_gpus", p.get("trainer_nodes", 0) * GPUS_PER_NODE)
            row["model_s"] = sum(rank0(b, gpus, True, p.get("root_node_receives", False), ln).values()) + ln.fixed
        elif mode == "colocated-sharded":
            row["model_s"] = sum(colocated_sharded(b, p["nodes"], p["replica_gpus"], ln).values()) + ln.fixed
        if "model_s" in row:
            row["model_s"] = round(row["model_s"], 3)
            row["published_over_model"] = round(p["seconds"] / row["model_s"], 2)
        out.append(row)
    return out


# ---- output ---------------------------------------------------------------------------------------------------------
def fmt(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.1f} s" if s < 100 else f"{s:.0f} s"


COLUMNS = {"colocated: copy only": "colocated-sharded", "colocated: reshard + copy": "colocated-sharded",
           "async today (routes)": "async-routed", "async, relayed": "async-sharded"}


def markdown(result: dict) -> str:
    out = []
    for name, dtype in dict.fromkeys((r["model"], r["dtype"]) for r in result["predictions"]):
        rows = [r for r in result["predictions"] if (r["model"], r["dtype"]) == (name, dtype)]
        first = rows[0]
        out.append(f"**{name} {dtype}** ({first['bytes'] / GB:,.0f} GB; inference replica of "
                   f"{first['replica_gpus']} GPU{'s' if first['replica_gpus'] > 1 else ''})\n")
        out.append("| nodes | GPUs | " + " | ".join(COLUMNS) + " |")
        out.append("|---" * (len(COLUMNS) + 2) + "|")
        for k in NODES:
            by = {r["mode"]: r for r in rows if r["nodes"] == k}
            if not by:
                continue
            cells = []
            for label, mode in COLUMNS.items():
                r = by.get(mode)
                s = r and (r["copy_only_s"] if label.endswith("copy only") else r["seconds"])
                cells.append("—" if r is None else fmt(s))
            out.append(f"| {k} | {k * GPUS_PER_NODE} | " + " | ".join(cells) + " |")
        out.append("")
    out.append("**Check against what was measured (1-2 GPUs)**\n")
    out.append("| configuration | predicted | measured | predicted / measured |\n|---|---|---|---|")
    out += [f"| {c['config']} | {c['predicted_s'] * 1e3:.1f} ms | {c['measured_s'] * 1e3:.1f} ms | {c['ratio']:.2f} |"
            for c in result["check"]]
    out.append("\n**Published figures of other systems**\n")
    out.append("| system | date | model | setup | published | this model, same bytes and layout (published / model) "
               "| rlsync's routes today, same setup (model) | source |")
    out.append("|---|---|---|---|---|---|---|---|")
    for p in result["published"]:
        ratio = p.get("published_over_model", 0)
        model = f"{fmt(p['model_s'])} ({p['mode']}; {ratio:.{2 if ratio < 10 else 0}f}x)" \
            if "model_s" in p else "—"
        source = f"[link]({p['url']})" if p["url"] else "environment facts"
        routes = fmt(p["rlsync_routes_s"]) if "rlsync_routes_s" in p else "—"
        out.append(f"| {p['system']} | {p['date']} | {p['model']} | {p['setup']} | {fmt(p['seconds'])} | {model} | "
                   f"{routes} | {source} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="print the tables of docs/scaling.md instead of JSON")
    args = parser.parse_args()
    inputs = measured()
    ln = links_from(inputs)
    result = {
        "inputs": {k: {"value": round(v, 6), "source": src} for k, (v, src) in inputs.items()},
        "assumptions": {
            "gpus_per_node": GPUS_PER_NODE, "nic_Gb/s_per_gpu": NIC_GBPS, "net_efficiency": NET_EFFICIENCY,
            "gpu_memory_GB": GPU_MEMORY / GB, "weight_share_of_replica_gpu": WEIGHT_SHARE,
            "train_bytes_per_param": TRAIN_BYTES_PER_PARAM, "train_share_of_gpu": TRAIN_SHARE,
            "async_split": "half the nodes train, half generate (one node: 4 GPUs each)",
            "left_out": "configurations whose trainer state or one inference replica does not fit in their GPUs",
            "links": {k: round(v / GB, 1) if k != "fixed" else round(v, 4) for k, v in asdict(ln).items()}
            | {"node": round(ln.node / GB, 1), "units": "GB/s; fixed in s"},
        },
        "predictions": predictions(ln),
        "check": check(inputs, ln),
        "published": published(ln),
    }
    print(markdown(result) if args.markdown else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
