"""Lookahead for ``het_row_replicated`` bags: a batch's partial sums leave their owners a step early.

Under TorchRec's ``TrainPipelineSparseDist`` the ids of batch i + 1 reach their owners during step
i, after its forward and before its backward (with lookahead on, the input dist's first stage, which
the pipeline waits then, also takes the ids). At that moment each owner pools batch i + 1's entries from its rows as they are. An entry none of whose rows an earlier
batch still has to step (:meth:`~torchrec_het.sharding.row_replicated.owner.DirectOwner.stale_entries`:
batch i's, whose gradients arrive at the end of its backward) already has its final value: it is
sent at once, and flies under step i's backward and optimizer step. The others (stale), and those
pooled from per-host blocks, are pooled again at batch i + 1's lookup, after batch i's step, and only
they travel in the output dist. Every entry's early value is sent (a stale one's is replaced), so
nothing waits before the early send; the reader learns which entries are stale from a flag per
entry sent beside it. Every partial is pooled from the same rows in the same order as without
lookahead: the same bits.

The backward is unchanged: one exchange of every entry's gradient, whose forward payload arrived
by the two exchanges (:meth:`~torchrec_het.sharding.common.exchange.Exchange.arrive`).

Design: docs/internals.md#row-replicated-lookahead
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchrec_het.sharding.common.exchange import Exchange, start_exchange
from torchrec_het.sharding.row_replicated.batch import ReplicatedBagBatch
from torchrec_het.sharding.row_replicated.owner import DirectOwner


@dataclass
class EarlyPartials:
    """One batch's partial sums sent early, both roles (its owner's and its reader's).

    Attributes:
        pooled: owner: ``[served entries, dim]``, every entry pooled at arrival (stale ones pooled again
            at the lookup).
        stale_served: owner: int64 ascending, the served entries pooled again at the lookup.
        stale_send: owner: elements of those per source rank.
        served: owner: elements of every served entry per source rank.
        sent: reader: elements of every sent entry per owner.
        sent_dest: reader: the owner of each sent entry.
        flags: reader: uint8 per sent entry, 1 where its owner pools it again (in flight until
            :meth:`stale_sent`); ``flags_work``: their all-to-all.
        exchange: the early partials in flight (every entry's).
        epoch: the owner's rows' epoch they were read at (a reload voids them).
        valid: False once the lookup found the rows reloaded since (every entry then travels at the
            output dist; a reload is collective, so every rank finds the same).
    """

    pooled: torch.Tensor
    stale_served: torch.Tensor
    stale_send: list[int]
    served: list[int]
    sent: list[int]
    sent_dest: torch.Tensor
    flags: torch.Tensor
    flags_work: object
    exchange: Exchange
    epoch: int
    valid: bool = True

    def stale_sent(self, world_size: int, dim: int) -> tuple[torch.Tensor, list[int]]:
        """Reader: the sent entries their owners pool again (ascending), and their elements per owner."""
        self.flags_work.wait()
        stale = self.flags.bool()
        per_owner = torch.bincount(self.sent_dest[stale], minlength=world_size).tolist()
        return stale.nonzero().flatten(), [c * dim for c in per_owner]


def start_early_partials(
    step: ReplicatedBagBatch, owner: DirectOwner, pg, codecs, training: bool
) -> EarlyPartials | None:
    """At batch ``step``'s arrival on its owners (every rank calls it, in the same order): plans the owner's batch
    (``step.owner``), registers it to step when ``training``, and, unless no rank sends to another,
    sends every entry's partial sum pooled now, with a flag per entry saying which the owner will
    pool again at the lookup (those with a row an earlier batch still steps). None: nothing sent
    early (the lookup pools and the output dist sends as without lookahead)."""
    batch = owner.plan(step.received)
    stale = owner.stale_entries(batch)  # before this batch is expected: its own rows do not count
    if training:
        owner.expect(batch)
    step.owner = batch
    if step.local_only:
        return None
    if step.host_entries is not None:  # pooled from this holder's per-host blocks at the lookup
        stale[step.host_entries] = True
    ws, dim = dist.get_world_size(pg), owner.dim
    served_source, sent_dest = step.served_source, step.sent_dest
    counts = torch.cat([
        torch.bincount(served_source, minlength=ws),
        torch.bincount(served_source[stale], minlength=ws),
        torch.bincount(sent_dest, minlength=ws),
    ]).tolist()  # fmt: skip
    served, stale_served, sent = counts[:ws], counts[ws : 2 * ws], counts[2 * ws :]
    flags = torch.empty(sum(sent), dtype=torch.uint8, device=stale.device)
    work = dist.all_to_all_single(flags, stale.to(torch.uint8), sent, served, group=pg, async_op=True)
    pooled = owner.pool(batch)
    served_elements, sent_elements = [c * dim for c in served], [c * dim for c in sent]
    exchange = start_exchange(pooled.reshape(-1), served_elements, sent_elements, pg, False, codecs)
    return EarlyPartials(
        pooled, stale.nonzero().flatten(), [c * dim for c in stale_served], served_elements, sent_elements,
        sent_dest, flags, work, exchange, owner.epoch,
    )  # fmt: skip


def lookup_partials(early: EarlyPartials, owner: DirectOwner, batch) -> torch.Tensor | None:
    """At the lookup, after the owner stepped what it owed: ``[served entries, dim]``, the stale
    entries pooled again from the rows as they are now; None when the rows were reloaded since the
    early read (``early.valid`` then False: pool every entry)."""
    early.valid = early.epoch == owner.epoch
    if not early.valid:
        return None
    partials = early.pooled
    if early.stale_served.numel():
        partials.index_copy_(0, early.stale_served, owner.pool_entries(batch, early.stale_served))
    return partials


def late_partials(early: EarlyPartials, partials: torch.Tensor, pg, codecs) -> tuple[Exchange, torch.Tensor]:
    """The output dist's exchange of the stale entries' partials (the rest came early), and where they
    go among the reader's sent entries."""
    dim = early.pooled.size(1)
    stale_sent, stale_recv = early.stale_sent(dist.get_world_size(pg), dim)
    send = partials.detach().view(-1, dim).index_select(0, early.stale_served).reshape(-1)
    return start_exchange(send, early.stale_send, stale_recv, pg, False, codecs), stale_sent


def arrived_partials(early: EarlyPartials, late: Exchange, stale_sent: torch.Tensor, dim: int) -> torch.Tensor:
    """Reader: every sent entry's partial, flat in sent order: the early ones, the stale ones replaced."""
    out = early.exchange.wait().view(-1, dim)
    out.index_copy_(0, stale_sent, late.wait().view(-1, dim))
    return out.reshape(-1)
