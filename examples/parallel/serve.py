"""Inference: a small decoder-only transformer generating tokens greedily with a KV cache, tensor-parallel.

    python examples/parallel/serve.py                                          # one process: the reference
    pycoll run -n 4 python examples/parallel/serve.py --backend pycoll --json serve.json
    pycoll run -n 4 python examples/parallel/serve.py --backend gloo --disaggregate
    torchrun --nproc-per-node 2 examples/parallel/serve.py --layers 2 --hidden 64 --heads 4

The weights are random (seeded), made whole on every rank, which keeps its slice: Megatron-style tensor
parallelism over the ranks, each holding heads/ranks attention heads (their query, key and value columns and
the output projection's rows) and ffn/ranks of the MLP (the first matrix's columns, the second's rows). Each
layer ends its attention and its MLP with an all_reduce of the partial outputs: two all_reduces per layer
per generated token, each of batch x hidden floats, latency-bound at these sizes.

--steps N batches of --batch prompts (--prompt-len random token ids each) are served one batch after the
other, after --warmup untimed ones; each batch is prefilled (the whole prompt at once, filling the KV cache)
and then decoded one token at a time to --new-tokens tokens. A step here is one generated token (for every
prompt of the batch): pycoll.mark_step() ends each. Reported: ttft_ms (the time from the batch's start to
its first token, median over batches), tpot_ms and tpot_p99_ms (the time of each later token, p50 and p99
over all of them), allreduces_per_token and allreduce_bytes_per_token (counted per decode step),
tokens (every prompt's generated ids) and min_logit_gap (the smallest top-1 minus top-2 logit: how close
greedy decoding came to a tie that rounding could flip).

--disaggregate: the first half of the ranks prefill, the second half decode, each half tensor-parallel
within itself. A prefill rank sends its share of the KV cache to its decode partner point to point, layer
by layer as each layer is computed (isend; the partner has posted an irecv for each), then the first
token. ttft_ms is then measured on the decode side (its cache and first token in hand) and includes the
hand-off: prefill_ms (the prefill ranks' time to the first token) and handoff_ms (ttft_ms - prefill_ms:
what the hand-off adds) with handoff_bytes (bytes sent per batch, all ranks) and handoff_messages.

The tokens equal the single-process run's (they are checked against it in tests/). Against gloo, the logits
(logits_sha, checksum) are bit-identical when a tensor-parallel group has at most 2 ranks (a + b has one
order), else equal within float32 rounding.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import Steps, env_layout, finish, init, make_parser, median, percentile, report

KVHook = Callable[[int, torch.Tensor, torch.Tensor], None]


class TPReduce:
    """The tensor-parallel all_reduce of a group (none when the group is one rank), counted."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size
        self.calls = 0
        self.bytes = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
            self.calls += 1
            self.bytes += t.numel() * t.element_size()
        return t


def full_weights(args: Any) -> Dict[str, torch.Tensor]:
    """The whole model's weights, drawn in a fixed order from one seeded generator (the same on every rank
    and for every number of ranks)."""
    g = torch.Generator().manual_seed(args.seed)
    d, f, v = args.hidden, args.ffn, args.vocab

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w = {"embed": randn(v, d), "pos": randn(args.prompt_len + args.new_tokens, d, scale=0.1)}
    for i in range(args.layers):
        for name in ("ln1", "ln2"):
            w[f"{i}.{name}.w"] = 1.0 + randn(d, scale=0.1)
            w[f"{i}.{name}.b"] = randn(d, scale=0.1)
        for name in ("wq", "wk", "wv", "wo"):
            w[f"{i}.{name}"] = randn(d, d, scale=d ** -0.5)
        w[f"{i}.bo"] = randn(d, scale=0.1)
        w[f"{i}.w1"] = randn(d, f, scale=d ** -0.5)
        w[f"{i}.b1"] = randn(f, scale=0.1)
        w[f"{i}.w2"] = randn(f, d, scale=f ** -0.5)
        w[f"{i}.b2"] = randn(d, scale=0.1)
    w["lnf.w"], w["lnf.b"] = 1.0 + randn(d, scale=0.1), randn(d, scale=0.1)
    w["head"] = randn(d, v, scale=d ** -0.5)
    return w


class Layer:
    """One decoder layer's slice on tensor-parallel rank `t` of `tp`: heads [t*h, (t+1)*h), h = heads/tp."""

    def __init__(self, w: Dict[str, torch.Tensor], i: int, heads: int, t: int, tp: int) -> None:
        d = w["embed"].shape[1]
        self.heads, self.head_dim = heads // tp, d // heads
        cols = slice(t * self.heads * self.head_dim, (t + 1) * self.heads * self.head_dim)
        ffn = w[f"{i}.w1"].shape[1] // tp
        inner = slice(t * ffn, (t + 1) * ffn)
        self.ln1 = (w[f"{i}.ln1.w"], w[f"{i}.ln1.b"])
        self.ln2 = (w[f"{i}.ln2.w"], w[f"{i}.ln2.b"])
        # column-parallel: this rank's heads' query, key and value columns, one matrix
        self.wqkv = torch.cat([w[f"{i}.{n}"][:, cols] for n in ("wq", "wk", "wv")], dim=1).contiguous()
        self.wo = w[f"{i}.wo"][cols].contiguous()  # row-parallel: partial sums, then all_reduce
        self.bo = w[f"{i}.bo"]
        self.w1, self.b1 = w[f"{i}.w1"][:, inner].contiguous(), w[f"{i}.b1"][inner].contiguous()
        self.w2, self.b2 = w[f"{i}.w2"][inner].contiguous(), w[f"{i}.b2"]

    def __call__(self, x: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 reduce: TPReduce) -> torch.Tensor:
        b, n, d = x.shape
        h = F.layer_norm(x, (d,), *self.ln1)
        q, k, v = (h @ self.wqkv).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k_cache[:, :, pos:pos + n] = k
        v_cache[:, :, pos:pos + n] = v
        if n > 1 and pos:
            raise ValueError("a chunk of several tokens must start at position 0 (prefill)")
        a = F.scaled_dot_product_attention(q, k_cache[:, :, :pos + n], v_cache[:, :, :pos + n], is_causal=n > 1)
        a = a.transpose(1, 2).reshape(b, n, self.heads * self.head_dim) @ self.wo
        x = x + reduce(a) + self.bo
        h = F.layer_norm(x, (d,), *self.ln2)
        m = F.gelu(h @ self.w1 + self.b1) @ self.w2
        return x + reduce(m) + self.b2


class Decoder:
    """The model on one tensor-parallel rank, with its KV cache (this rank's heads only)."""

    def __init__(self, args: Any, t: int, tp: int, reduce: TPReduce) -> None:
        w = full_weights(args)
        self.embed, self.pos, self.head = w["embed"], w["pos"], w["head"]
        self.lnf = (w["lnf.w"], w["lnf.b"])
        self.layers = [Layer(w, i, args.heads, t, tp) for i in range(args.layers)]
        self.reduce = reduce
        heads, head_dim = args.heads // tp, args.hidden // args.heads
        shape = (args.batch, heads, args.prompt_len + args.new_tokens, head_dim)
        self.k = [torch.zeros(shape) for _ in self.layers]
        self.v = [torch.zeros(shape) for _ in self.layers]

    def forward(self, ids: torch.Tensor, pos: int, on_kv: Optional[KVHook] = None) -> torch.Tensor:
        """The next-token logits [batch, vocab] after `ids` [batch, n] placed at positions pos..pos+n-1;
        on_kv(layer, k, v) sees each layer's new keys and values as soon as they are computed."""
        x = self.embed[ids] + self.pos[pos:pos + ids.shape[1]]
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, self.k[i], self.v[i], self.reduce)
            if on_kv is not None:
                n = ids.shape[1]
                on_kv(i, self.k[i][:, :, pos:pos + n], self.v[i][:, :, pos:pos + n])
        return F.layer_norm(x[:, -1], (x.shape[-1],), *self.lnf) @ self.head


def greedy(logits: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """The argmax token of each row and the smallest gap between a row's two best logits."""
    top = logits.topk(2, dim=-1)
    return top.indices[:, 0], float((top.values[:, 0] - top.values[:, 1]).min())


class Roles:
    """Which ranks prefill and which decode, the tensor-parallel group of this rank and its place in it.
    Without --disaggregate every rank does both, over one group of all ranks."""

    def __init__(self, disaggregate: bool, rank: int, world: int) -> None:
        self.tp = world // 2 if disaggregate else world
        prefill, decode = list(range(self.tp)), list(range(world - self.tp, world))
        if disaggregate:  # every rank takes part in creating every group
            groups = {"prefill": dist.new_group(prefill), "decode": dist.new_group(decode)}
            self.role = "prefill" if rank < self.tp else "decode"
            self.group = groups[self.role]
            self.peer = rank + self.tp if self.role == "prefill" else rank - self.tp
        else:
            self.role, self.group, self.peer = "both", None, None
        self.t = rank % self.tp  # this rank's place in its tensor-parallel group
        self.prefills, self.decodes = self.role in ("both", "prefill"), self.role in ("both", "decode")


def check(args: Any, world: int) -> Optional[str]:
    """What is wrong with these options on `world` ranks, or None."""
    if args.disaggregate and (world < 2 or world % 2):
        return f"--disaggregate splits the ranks into a prefill half and a decode half: it needs an even " \
               f"number of ranks, got {world}"
    tp = world // 2 if args.disaggregate else world
    for name in ("layers", "hidden", "heads", "ffn", "vocab", "prompt_len", "batch"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.vocab < 2:
        return f"--vocab must be at least 2, got {args.vocab}"
    if args.new_tokens < 2:
        return f"--new-tokens must be at least 2 (the first comes from the prefill), got {args.new_tokens}"
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} is not a multiple of --heads {args.heads}"
    if args.heads % tp:
        return f"--heads {args.heads} cannot be split over a tensor-parallel degree of {tp} " \
               f"({world} ranks{', halved by --disaggregate' if args.disaggregate else ''}): " \
               f"give a multiple of {tp}"
    if args.ffn % tp:
        return f"--ffn {args.ffn} cannot be split over a tensor-parallel degree of {tp}: give a multiple of {tp}"
    return None


def main() -> None:
    parser = make_parser(__doc__)
    parser.set_defaults(steps=3)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads, a multiple of the TP degree (default 8)")
    parser.add_argument("--ffn", type=int, default=None, help="MLP inner width (default 4 x hidden)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    parser.add_argument("--batch", type=int, default=4, help="prompts served together (default 4)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens in each prompt (default 64)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt (default 16)")
    parser.add_argument("--disaggregate", action="store_true",
                        help="prefill on the first half of the ranks, decode on the second half")
    args = parser.parse_args()
    if args.ffn is None:
        args.ffn = 4 * args.hidden
    layout = env_layout()
    problem = check(args, layout.world)
    if problem:
        parser.error(problem)
    init(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    roles = Roles(args.disaggregate, rank, world)
    reduce = TPReduce(roles.group, roles.tp)
    model = Decoder(args, roles.t, roles.tp, reduce)
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(0, args.vocab, (args.warmup + args.steps, args.batch, args.prompt_len), generator=g)

    steps = Steps(args.warmup * args.new_tokens)
    mine: List[Dict[str, Any]] = []
    with torch.inference_mode():
        for b in range(args.warmup + args.steps):
            rec = serve_batch(model, prompts[b], args, roles, reduce, steps)
            if b >= args.warmup:
                mine.append(rec)

    every: List[Any] = [None] * world
    dist.all_gather_object(every, mine)
    report(args, steps, **summarize(every, args, roles))
    finish(args.backend)


def serve_batch(model: Decoder, ids: torch.Tensor, args: Any, roles: Roles, reduce: TPReduce,
                steps: Steps) -> Dict[str, Any]:
    """Generate --new-tokens tokens for one batch of prompts: prefill, then decode step by step; this rank's
    record of it (its times, the tokens it knows, what it sent)."""
    n, plen = args.new_tokens, args.prompt_len
    rec: Dict[str, Any] = {"role": roles.role, "tpot_ms": [], "gap": float("inf")}
    tokens = torch.empty(args.batch, n, dtype=torch.int64)
    dist.barrier()  # the batch arrives: every rank starts its clock together
    t0 = time.perf_counter()
    with steps.step():
        if roles.role == "decode":
            tokens[:, 0] = receive_prefill(model, args, roles.peer)
        else:
            sent: List[Any] = []
            sizes = [0]

            def hand_off(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
                for j, t in enumerate((k.contiguous(), v.contiguous())):
                    sent.append((dist.isend(t, roles.peer, tag=2 * layer + j), t))
                    sizes[0] += t.numel() * t.element_size()

            reduce.calls = reduce.bytes = 0
            logits = model.forward(ids, 0, hand_off if roles.role == "prefill" else None)
            tokens[:, 0], rec["gap"] = greedy(logits)
            rec["prefill_ms"] = (time.perf_counter() - t0) * 1e3
            rec["prefill_allreduce_bytes"] = reduce.bytes
            if roles.role == "prefill":
                first = tokens[:, 0].clone()
                sent.append((dist.isend(first, roles.peer, tag=2 * args.layers), first))
                sizes[0] += first.numel() * first.element_size()
                for work, _ in sent:
                    work.wait()
                rec["handoff_bytes"], rec["handoff_messages"] = sizes[0], len(sent)
    rec["ttft_ms"] = (time.perf_counter() - t0) * 1e3

    reduce.calls = reduce.bytes = 0
    for i in range(1, n):
        with steps.step():
            if roles.decodes:
                t = time.perf_counter()
                logits = model.forward(tokens[:, i - 1:i], plen + i - 1)
                tokens[:, i], gap = greedy(logits)
                rec["tpot_ms"].append((time.perf_counter() - t) * 1e3)
                rec["gap"] = min(rec["gap"], gap)
    if roles.decodes:
        rec["tokens"] = tokens.tolist()
        rec["allreduces"], rec["allreduce_bytes"] = reduce.calls / (n - 1), reduce.bytes / (n - 1)
        rec["logits"] = logits.numpy().tobytes()
    return rec


def receive_prefill(model: Decoder, args: Any, peer: int) -> torch.Tensor:
    """The decode side of the hand-off: an irecv for every layer's keys and values and for the first token,
    all posted at once; each layer's into its place in the cache. Returns the first token of each prompt."""
    k0 = model.k[0]
    shape = (k0.shape[0], k0.shape[1], args.prompt_len, k0.shape[3])
    bufs = [torch.empty(shape) for _ in range(2 * args.layers)]
    first = torch.empty(args.batch, dtype=torch.int64)
    works = [dist.irecv(buf, peer, tag=j) for j, buf in enumerate(bufs)]
    works.append(dist.irecv(first, peer, tag=2 * args.layers))
    for j, buf in enumerate(bufs):
        works[j].wait()
        cache = model.k[j // 2] if j % 2 == 0 else model.v[j // 2]
        cache[:, :, :args.prompt_len] = buf
    works[-1].wait()
    return first


def summarize(every: List[List[Dict[str, Any]]], args: Any, roles: Roles) -> Dict[str, Any]:
    """The job's results from every rank's batch records: times are the slowest rank's for each batch or
    token; tokens are the first decoding rank's, checked against every other decoding rank's."""
    batches = range(args.steps)
    decoders = [r for r, recs in enumerate(every) if recs and recs[0]["role"] in ("both", "decode")]
    prefillers = [r for r, recs in enumerate(every) if recs and recs[0]["role"] in ("both", "prefill")]
    lead = every[decoders[0]]
    for r in decoders[1:]:
        if [rec["tokens"] for rec in every[r]] != [rec["tokens"] for rec in lead]:
            raise RuntimeError(f"rank {r} generated other tokens than rank {decoders[0]}: the tensor-parallel "
                               f"all_reduce left the ranks with different activations")
    ttft = [max(every[r][b]["ttft_ms"] for r in decoders) for b in batches]
    prefill = [max(every[r][b]["prefill_ms"] for r in prefillers) for b in batches]
    tpot = [max(every[r][b]["tpot_ms"][i] for r in decoders) for b in batches for i in range(args.new_tokens - 1)]
    logits = b"".join(rec["logits"] for rec in lead)
    flat = torch.frombuffer(bytearray(logits), dtype=torch.float32)
    out: Dict[str, Any] = {
        "ttft_ms": median(ttft), "tpot_ms": median(tpot), "tpot_p99_ms": percentile(tpot, 99),
        "tokens": [row for rec in lead for row in rec["tokens"]],
        "tp": roles.tp, "disaggregate": args.disaggregate,
        "allreduces_per_token": lead[0]["allreduces"], "allreduce_bytes_per_token": lead[0]["allreduce_bytes"],
        "prefill_ms": median(prefill),
        "prefill_allreduce_bytes": every[prefillers[0]][0]["prefill_allreduce_bytes"],
        "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "batch": args.batch,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "min_logit_gap": min(rec["gap"] for recs in every for rec in recs),
        "logits_sha": hashlib.sha256(logits).hexdigest(), "checksum": float(flat.to(torch.float64).abs().sum()),
        "match": "bit-identical" if roles.tp <= 2 else "float32 rounding",
    }
    if args.disaggregate:
        out["handoff_ms"] = median(t - p for t, p in zip(ttft, prefill))
        out["handoff_bytes"] = sum(every[r][0]["handoff_bytes"] for r in prefillers)
        out["handoff_messages"] = sum(every[r][0]["handoff_messages"] for r in prefillers)
    return out


if __name__ == "__main__":
    main()
