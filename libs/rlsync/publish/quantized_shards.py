"""The quantizing stage (rlsync.publish.quantized) over a sharded model's ranks: each rank sends the FP8
values of the boxes it holds and the scales of the blocks whose first element it holds, bit for bit those
of quantizing the whole tensor (rlsync.quant.fp8_shards: a block that ranks' boxes cut gets one amax, one
all-reduce MAX per update for every weight). The routed plan sends each byte once, as for any tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlsync.errors import InvalidArgument, Unavailable
from rlsync.publish.layout import RankShards
from rlsync.quant.fp8_blocks import FP8, scales_of
from rlsync.quant.fp8_box_kernel import box_amax, box_values
from rlsync.quant.fp8_shards import BlockPlan, block_plan, checked, exchange, quantize_box
from rlsync.transfer.checksum import BoxSums, share_sums, tensor_sums
from rlsync.transfer import kept
from rlsync.transfer.manifest import Spec
from rlsync.transfer.routes import Box, Piece, TensorInfo, layout, share
from rlsync.transfer.v1 import transfer_pb2 as pb

WEIGHT, SCALE = 1, 2  # what a tensor of the stage is of its base tensor (0: the base tensor as it is)


class QuantizedShards:
    """What rank `base.rank` holds of the stage's tensors (`specs`; `plan[j]` = (base index, part)) and
    the pieces cut from it: RankShards' interface. A weight's boxes are those of its base tensor, its
    scales' the blocks each rank sends (BlockPlan.owned); `refresh` makes the scales of this rank's
    blocks from the weights as they are (every rank, in step), and pieces are quantized as they are cut."""

    def __init__(self, base: RankShards, specs: Sequence[Spec], plan: Sequence[tuple[int, int]],
                 fmt: pb.WeightFormat, device: torch.device):
        self.base, self.rank, self.world = base, base.rank, base.world
        self.specs, self.plan, self.device = list(specs), list(plan), device
        self.block, self.pow2 = tuple(fmt.fp8.block), fmt.fp8.pow2_scales
        held = base.layout.held
        self.blocks: dict[int, BlockPlan] = {}  # base index -> how the ranks make its scales
        for i, part in self.plan:
            if part != WEIGHT:
                continue
            shape = base.layout.tensors[i].shape
            boxes = tuple(held[r][i] for r in range(self.world))
            if any(len(b) != 2 for ranks in boxes for b in ranks):
                raise InvalidArgument(f"{base.layout.tensors[i].name!r} is not 2-D: only 2-D weights are quantized "
                                      "to block FP8")
            self.blocks[i] = block_plan(tuple(shape), boxes, self.block)
        infos = [TensorInfo(s.name, tuple(s.shape), s.dtype.itemsize) for s in self.specs]
        self.layout = layout(infos, [[self.blocks[i].owned[r] if part == SCALE else held[r][i] for i, part in self.plan]
                                     for r in range(self.world)])
        # The scales of every block this rank touches, on the whole grid (the rest unused), kept in place:
        # receiver ranks on this GPU pull views of them (held_tensors), and find them where they were. One
        # buffer for all: zeroed, made the amaxes, then the scales, each for all weights at once.
        sizes = [p.grid[0] * p.grid[1] for p in self.blocks.values()]
        self._grids = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        self.scales = {i: g.view(p.grid) for (i, p), g in zip(self.blocks.items(), self._grids.split(sizes))}
        self._values: dict[tuple[int, Box], torch.Tensor] = {}  # FP8 boxes for pulls, made when first asked
        self._fresh = False
        self._sums: dict[torch.dtype | None, BoxSums] = {}  # checksum_share's, by the dtype it sums in

    def refresh(self, ranks) -> None:
        """Every rank, in step: the scales of the blocks its boxes touch, from the weights as they are now
        (partial amaxes, the cut blocks' combined by `ranks.max_of` in one call). A rank that cannot make its
        partial amaxes says so first (`ranks.agree`), so that every rank raises before the exchange, not
        one of them in another collective than the others."""
        self._fresh, error, values = False, None, {}
        try:  # (the partial amaxes into the grids, in one launch a dtype on a GPU)
            with torch.no_grad():
                self._grids.zero_()
                values = {(i, box): x for i in self.blocks for box, x in checked(
                    [(box, self.base.piece(Piece(i, box))) for box in self.base.layout.held[self.rank][i]])}
                box_amax([(x, box, self.scales[i]) for (i, box), x in values.items()], self.block)
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            error = e
        if ranks.agree(error is None):
            raise error or Unavailable("another rank of the trainer could not make its FP8 block scales (see its log)")
        with torch.no_grad():
            exchange(list(self.scales.values()), list(self.blocks.values()), ranks.max_of)
            self._grids.copy_(scales_of(self._grids, self.pow2))
            # the FP8 boxes receivers pull (a repeat's export is kept), in one launch a dtype
            box_values([(values[i, box], box, self.scales[i], q) for (i, box), q in self._values.items()], self.block)
        if self._values and self.device.type == "cuda":  # another process reads them next (held_tensors)
            torch.cuda.current_stream(self.device).synchronize()
        self._fresh = True

    def where(self) -> tuple:
        """Where held_tensors()' tensors lie (ShardedSender keys a repeat's export by it, then asks for them):
        the FP8 boxes, made here the first time (so that the second send finds the first's export; before the
        first refresh() too, which then fills them: an offer describes them before it refreshes), and the scales
        stay where they were made, and refresh() brings them up to date; the rest is the base's."""
        for j, boxes in enumerate(self.layout.held[self.rank]):
            i, part = self.plan[j]
            for box in boxes if part == WEIGHT else ():
                self._quantized_box(i, box)
        return self.base.where(), kept.where([*self._values.values(), *self.scales.values()])

    def _check_fresh(self) -> None:
        if not self._fresh:  # (never made, or the last refresh failed)
            raise RuntimeError("a quantized piece was cut before the ranks made its scales (call refresh)")

    def piece(self, p: Piece) -> torch.Tensor:
        """The piece's values, contiguous, in the stage's dtype: FP8 for a weight (quantized from this
        rank's values under the whole tensor's scales), fp32 for its scales."""
        i, part = self.plan[p.tensor]
        if part == SCALE:
            self._check_fresh()
            return self.scales[i][tuple(slice(a, b) for a, b in p.box)].contiguous()
        values = self.base.piece(Piece(i, p.box))
        if part == 0:
            return values
        self._check_fresh()
        with torch.no_grad():
            return self._quantize(i, p.box, values)

    def held_tensors(self) -> list[list[torch.Tensor]]:
        """This rank's boxes as tensors, per stage tensor in its layout's order (rlsync.transfer.pulls):
        the base's for tensors sent as they are; a weight's FP8 boxes in buffers kept from one update to
        the next (filled by refresh(), made at their first use), and views of its scales. Before the first
        refresh() their values are not made yet: receivers read them only once an offer is made, after it."""
        base = self.base.held_tensors()
        out = []
        with torch.no_grad():
            for j, boxes in enumerate(self.layout.held[self.rank]):
                i, part = self.plan[j]
                if part == 0:
                    out.append(base[i])
                elif part == SCALE:
                    out.append([self.scales[i][tuple(slice(a, b) for a, b in box)] for box in boxes])
                else:
                    out.append([self._quantized_box(i, box) for box in boxes])
        if self.device.type == "cuda":  # another process reads them next, ordered by no stream of ours
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def _quantized_box(self, i: int, box: Box) -> torch.Tensor:
        """The box's FP8 buffer, made at its first use (and filled, once the scales are made); refresh() fills it
        at every send."""
        q = self._values.get((i, box))
        if q is None:
            q = self._values[i, box] = torch.empty([b - a for a, b in box], dtype=FP8, device=self.device)
            if self._fresh:
                q.copy_(self._quantize(i, box))
        return q

    def _quantize(self, i: int, box: Box, values: torch.Tensor | None = None) -> torch.Tensor:
        """The FP8 values of `box` of base tensor i (`values`: its values, else cut now) under the scales."""
        values = self.base.piece(Piece(i, box)) if values is None else values
        return quantize_box(values, box, self.scales[i], self.block)

    def checksum_share(self, dtype: torch.dtype | None = None) -> list[tuple[int, int]]:
        """As RankShards.checksum_share, over the stage's tensors: FP8 values and scales as sent, never cast."""
        def summed(p: Piece) -> torch.Tensor:
            v = self.piece(p)
            return v.to(dtype) if dtype is not None and self.plan[p.tensor][1] == 0 and v.is_floating_point() else v

        pieces = share(self.layout, self.rank)
        sums = self._sums.get(dtype)
        if sums is None:
            sums = self._sums[dtype] = share_sums(pieces, [s.shape for s in self.specs])
        return tensor_sums(pieces, sums(map(summed, pieces)), len(self.specs))
