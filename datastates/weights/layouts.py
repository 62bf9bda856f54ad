"""What one rank of an inference engine holds of a published version, read from its Hugging Face tensors: the
packed layout vLLM's and SGLang's models keep, and the slices of the engine's own tensor parallelism, each read
from the safetensors files alone (the rows or columns a rank needs, never a whole tensor it slices).

The rules are those of vLLM's parallel layers (SGLang's are the same), for rank r of T:
  column-parallel (q/k/v, gate/up, an expert's gate/up)   the r-th of T blocks of rows
  query heads                                             heads/T per rank (T must divide them)
  key/value heads                                         kv/T per rank when T < kv (T must divide kv); else one,
                                                          head r // (T/kv), the same on T/kv ranks (kv divides T)
  row-parallel (o_proj, down_proj, an expert's down)      the r-th of T blocks of columns; a bias whole
  vocabulary-parallel (embed_tokens, lm_head)             rows [r*P, (r+1)*P) of the real ones, P the vocabulary
                                                          padded to 64 rows, over T (the engine pads its parameter
                                                          with zero rows after them)
  anything else (norms, a router)                         whole on every rank
Packed: a layer's q, k and v rows concatenated along dim 0 as `self_attn.qkv_proj` (the rank's q, then its k, then
its v), gate then up as `mlp.gate_up_proj`, and an MoE layer's experts stacked as FusedMoE holds them:
`experts.w13_weight` [experts, gate + up rows, hidden] and `experts.w2_weight` [experts, hidden, down columns].

Expert parallelism (vLLM's `--enable-expert-parallel`: E experts over the engine's EP ranks, E = base * P + rem): EP
rank r of P holds whole experts, none sliced by TP, base + 1 of them for r < rem and base after, the contiguous block
from r * base + min(r, rem) (placement "linear", vLLM's default) or experts r, r + P, r + 2P, ... ("round_robin"),
stacked in that order; unpacked, they keep their global names. Attention and the rest follow the TP rules above.

The families --save-hf exports with these layers have a mapping (FAMILIES); GPT-2's transposed Conv1D weights and
DeepSeek-V3's latent attention have none, and are refused by name.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

FAMILIES = ("llama", "mixtral", "qwen2", "qwen3", "qwen3_moe")
VOCAB_PADDING = 64  # vLLM's and SGLang's DEFAULT_VOCAB_PADDING_SIZE
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
ATTENTION = re.compile(r"(?P<at>.+\.self_attn\.)(?P<part>[qkv])_proj\.(?P<kind>weight|bias)$")
MLP = re.compile(r"(?P<at>.+\.mlp\.)(?P<part>gate|up)_proj\.(?P<kind>weight|bias)$")
ROW = re.compile(r".+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
EXPERT = re.compile(r"(?P<at>.+\.)experts\.(?P<e>\d+)\.(?P<part>gate_proj|w1|up_proj|w3|down_proj|w2)\.weight$")
GATE_UP = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}  # Mixtral's w1 is the gate, w3 the up projection


class LayoutError(ValueError):
    """A version this layout cannot take (a family without a mapping, a TP that does not divide a tensor)."""


@dataclass(frozen=True)
class Block:
    """`length` rows (dim 0) or columns (dim 1) of the Hugging Face tensor `name` from `start` (dim None: all of
    it)."""
    name: str
    dim: int | None
    start: int
    length: int


@dataclass(frozen=True)
class Held:
    """A tensor one rank holds: `parts`' blocks concatenated along dim 0, one part, or one per expert, stacked
    (`stacked`)."""
    name: str
    parts: tuple[tuple[Block, ...], ...]
    stacked: bool = False


@dataclass(frozen=True)
class Experts:
    """The experts EP rank `rank` of `size` holds (`size` 1: every expert, sliced by TP)."""
    rank: int = 0
    size: int = 1
    placement: str = "linear"

    def local(self, total: int) -> list[int]:
        """The global ids of the experts this rank holds, in its local order."""
        if self.placement == "round_robin":
            return list(range(self.rank, total, self.size))
        base, rem = divmod(total, self.size)
        start = self.rank * base + min(self.rank, rem)
        return list(range(start, start + base + (self.rank < rem)))


def plan(config: dict, shapes: dict[str, tuple], packed: bool, rank: int, size: int,
         experts: Experts = Experts()) -> list[Held]:
    """The tensors rank `rank` of `size` (and EP rank `experts.rank`) holds of a version of `config` (its
    config.json) whose tensors have `shapes`, in the packed layout or under the Hugging Face names; LayoutError
    naming the tensor and the sizes where the engine would refuse."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise LayoutError(f"model_type {family!r} has no packed or tensor-parallel layout here (these have: "
                          f"{', '.join(FAMILIES)}); read its Hugging Face tensors whole")
    if not 0 <= rank < size:
        raise LayoutError(f"tensor-parallel rank {rank} of {size}: the ranks of {size} are 0 to {size - 1}")
    if not 0 <= experts.rank < experts.size or experts.placement not in ("linear", "round_robin"):
        raise LayoutError(f"expert-parallel rank {experts.rank} of {experts.size}, placement "
                          f"{experts.placement!r}: the ranks are 0 to {experts.size - 1}, the placements linear "
                          "and round_robin")
    slicer = _Slicer(config, shapes, rank, size, experts)
    held: dict[str, dict] = {}  # name -> its parts' blocks, by position (q/k/v, gate/up, expert), in order
    for name in sorted(shapes):
        placed = slicer.place(name, packed)
        if placed is not None:
            (out, position), block = placed
            held.setdefault(out, {})[position] = block
    return [_held(out, blocks) for out, blocks in held.items()]


def _held(name: str, blocks: dict) -> Held:
    if not isinstance(next(iter(blocks)), tuple):  # a part at each position: concatenated
        return Held(name, (tuple(blocks[p] for p in sorted(blocks)),))
    experts = sorted({e for e, _ in blocks})
    if experts != list(range(len(experts))):
        raise LayoutError(f"{name}: the version's experts are {experts}, not 0 to {len(experts) - 1}")
    per_expert = [tuple(b for (e, _), b in sorted(blocks.items()) if e == x) for x in experts]
    if len({len(p) for p in per_expert}) != 1:
        raise LayoutError(f"{name}: the experts of the version do not all have the same projections")
    return Held(name, tuple(per_expert), stacked=True)


class _Slicer:
    """Where each Hugging Face tensor goes for one rank: (the held tensor's name, its position there, the block)."""

    def __init__(self, config: dict, shapes: dict[str, tuple], rank: int, size: int, experts: Experts):
        self.shapes, self.rank, self.size = shapes, rank, size
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.local = None  # global expert id -> its index on this EP rank (None: every expert, TP-sliced)
        if experts.size > 1:
            total = config.get("num_local_experts") or config.get("num_experts") or 0
            if total < experts.size:
                raise LayoutError(f"{total} experts (config.json) over {experts.size} expert-parallel ranks: each "
                                  "rank needs one at least")
            self.local = {g: i for i, g in enumerate(experts.local(total))}

    def place(self, name: str, packed: bool) -> tuple[tuple[str, object], Block] | None:
        if m := EXPERT.match(name):
            return self.expert(name, m, packed)
        if m := ATTENTION.match(name):
            query = self.query(f"{m['at']}q_proj.{m['kind']}")  # the query heads first, as the engine checks them
            block = query if m["part"] == "q" else self.key_value(name)
            return (f"{m['at']}qkv_proj.{m['kind']}", "qkv".index(m["part"])) if packed else (name, 0), block
        if m := MLP.match(name):
            return (f"{m['at']}gate_up_proj.{m['kind']}", GATE_UP[m["part"] + "_proj"]) if packed else (name, 0), \
                self.rows(name)
        if ROW.match(name):
            return (name, 0), self.columns(name)
        if name in VOCAB:
            return (name, 0), self.vocabulary(name)
        return (name, 0), Block(name, None, 0, 0)  # whole on every rank

    def expert(self, name: str, m: re.Match, packed: bool) -> tuple[tuple[str, object], Block] | None:
        """An expert's projection: TP-sliced on every rank, or whole on the EP rank that holds it (None: another
        rank's)."""
        e, part = int(m["e"]), m["part"]
        if self.local is not None:
            if e not in self.local:
                return None
            e, block = self.local[e], Block(name, None, 0, 0)
        else:
            block = self.rows(name) if part in GATE_UP else self.columns(name)
        if not packed:
            return (name, 0), block
        if part in GATE_UP:
            return (f"{m['at']}experts.w13_weight", (e, GATE_UP[part])), block
        return (f"{m['at']}experts.w2_weight", (e, 0)), block

    def rows(self, name: str) -> Block:
        """Column-parallel: the rank's block of rows."""
        rows = self.shapes[name][0]
        if rows % self.size:
            raise LayoutError(f"{name}: its {rows} rows do not divide among {self.size} tensor-parallel ranks")
        return Block(name, 0, self.rank * rows // self.size, rows // self.size)

    def columns(self, name: str) -> Block:
        """Row-parallel: the rank's block of columns."""
        cols = self.shapes[name][1]
        if cols % self.size:
            raise LayoutError(f"{name}: its {cols} columns do not divide among {self.size} tensor-parallel ranks")
        return Block(name, 1, self.rank * cols // self.size, cols // self.size)

    def query(self, name: str) -> Block:
        if self.heads % self.size:
            raise LayoutError(f"{name}: its {self.heads} query heads do not divide among {self.size} "
                              f"tensor-parallel ranks")
        return self.rows(name)

    def key_value(self, name: str) -> Block:
        """T < kv: kv/T heads each; else the head r // (T/kv), replicated on T/kv ranks."""
        kv, size = self.kv_heads, self.size
        if (kv % size) if size < kv else (size % kv):
            raise LayoutError(f"{name}: {kv} key/value heads and {size} tensor-parallel ranks: one must divide the "
                              f"other (the heads are split among fewer ranks, or each replicated on several)")
        head = self.shapes[name][0] // kv
        if size < kv:
            return Block(name, 0, self.rank * (kv // size) * head, kv // size * head)
        return Block(name, 0, self.rank // (size // kv) * head, head)

    def vocabulary(self, name: str) -> Block:
        vocab = self.shapes[name][0]
        padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        if padded % self.size:
            raise LayoutError(f"{name}: its {vocab} rows, padded to {padded}, do not divide among {self.size} "
                              f"tensor-parallel ranks")
        per_rank = padded // self.size
        start = min(self.rank * per_rank, vocab)
        return Block(name, 0, start, min(start + per_rank, vocab) - start)


@dataclass(frozen=True)
class Place:
    """Where a Hugging Face tensor's block lies in a held tensor: its part (an expert's index when stacked, else
    None), from row `row` of that part."""
    held: str
    part: int | None
    block: Block
    row: int


def places(plan_: list[Held], shapes: dict[str, tuple]) -> dict[str, list[Place]]:
    """Hugging Face name -> where its blocks lie in the tensors `plan_` holds (a name the rank does not hold:
    absent)."""
    out: dict[str, list[Place]] = {}
    for h in plan_:
        for i, blocks in enumerate(h.parts):
            row = 0
            for b in blocks:
                out.setdefault(b.name, []).append(Place(h.name, i if h.stacked else None, b, row))
                row += b.length if b.dim == 0 else (shapes[b.name][0] if shapes[b.name] else 1)
    return out


def apply_change(held: dict[str, torch.Tensor], where: list[Place], shape: tuple, change: dict) -> None:
    """One Hugging Face tensor's change (a delta's: its flat positions and new values, or the whole tensor) applied
    in place to the held tensors it has blocks in (`places`), exactly: each block takes the changes inside it."""
    cols = math.prod(shape[1:])
    for p in where:
        target = held[p.held].data
        target = (target[p.part] if p.part is not None else target).view(-1)
        if "full" in change:
            whole = change["full"].reshape(shape)
            piece = whole if p.block.dim is None else whole.narrow(p.block.dim, p.block.start, p.block.length)
            target[p.row * cols:p.row * cols + piece.numel()] = piece.reshape(-1).to(target.dtype)
            continue
        index, value = change["index"].long(), change["value"].to(target.dtype)
        if p.block.dim is None:
            target[index + p.row * cols] = value
        elif p.block.dim == 0:
            row = index // cols
            inside = (row >= p.block.start) & (row < p.block.start + p.block.length)
            target[index[inside] + (p.row - p.block.start) * cols] = value[inside]
        else:
            row, col = index // shape[1], index % shape[1]
            inside = (col >= p.block.start) & (col < p.block.start + p.block.length)
            target[row[inside] * p.block.length + col[inside] - p.block.start] = value[inside]


def read(held: Held, slice_of) -> torch.Tensor:
    """The tensor `held`, its blocks read through `slice_of(name)` (a safetensors slice: only those bytes)."""
    parts = [_concatenated([_read(b, slice_of) for b in blocks]) for blocks in held.parts]
    return torch.stack(parts) if held.stacked else parts[0]


def _concatenated(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One tensor of its own (a block is a view of the file's mapping: copied, its bytes alone)."""
    return tensors[0].clone(memory_format=torch.contiguous_format) if len(tensors) == 1 else torch.cat(tensors)


def _read(block: Block, slice_of) -> torch.Tensor:
    whole = slice_of(block.name)
    if block.dim is None:
        return whole[...]
    end = block.start + block.length
    return whole[block.start:end] if block.dim == 0 else whole[:, block.start:end]
