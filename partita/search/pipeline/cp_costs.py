"""The layer costs of a layout with context parallelism ``cp`` (``search/pricing/context_parallel.py``).

:class:`ContextParallelCosts` is the :class:`~partita.search.pipeline.stage_cost.SolverCosts` the stage
formulas read, for one ``cp``: every layer solved by the intra-op ILP at sequence ``S / cp`` (its
``training`` is ``context_parallel.local_training``), then each layer's attention terms added to its
:class:`LayerCost`: the extra attention compute to the forward and backward, the exposed K/V
all-gathers to the forward and reduce-scatters to the backward (both also to ``comm_s``, which the stage
formulas split half and half, as they are: the gather's output and the scatter's input are one size),
the gathered K/V kept for the backward to the saved activations. The stage DP then prices ``dp * cp``
replicas of ``S / cp`` tokens: gradient sync and ZeRO over all of them (the pricing module's docstring).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from partita.cluster import Cluster, DeviceType
from partita.ir import Graph
from partita.search.pipeline.stage_cost import LayerCost, SolverCosts
from partita.search.pricing import context_parallel as cpx
from partita.search.pricing.config import TrainingConfig


class ContextParallelCosts(SolverCosts):
    """:class:`SolverCosts` of a ``cp``-way context-parallel layout (module docstring). ``full_training``
    keeps the configuration as given (sequence ``S``); ``training`` is the one layers are solved at."""

    def __init__(
        self,
        graph: Graph,
        cluster: Cluster,
        training: TrainingConfig,
        cp: int,
        memo: Any = None,
        tp_style: str | None = None,
    ) -> None:
        cpx.check(graph, training, cp)
        self.cp = cp
        self.full_training = training
        super().__init__(graph, cluster, cpx.local_training(training, cp), memo, tp_style)
        self._terms: dict[tuple, cpx.CPTerms] = {}

    def terms(self, index: int, device: DeviceType, tp: int, micro_batch: int) -> cpx.CPTerms:
        """The context-parallel terms of layer ``index`` (one per layer kind, as the ILP's solves)."""
        key = self._key(index, device, tp, micro_batch) + (micro_batch,)
        if key not in self._terms:
            link = cpx.cp_link(
                device, self.cp, tp, self.cluster.gpus_per_node(device.name), self.cluster.network_for(device.name)
            )
            self._terms[key] = cpx.layer_terms(
                self.graph,
                self.graph.layers[index],
                self.cost_model(device),
                link,
                cp=self.cp,
                tp=tp,
                micro_batch=micro_batch,
                local_seq=self.training.seq_len,
                dtype=self.training.dtype,
            )
        return self._terms[key]

    def layer(self, index: int, device: DeviceType, tp: int, micro_batch: int):  # noqa: ANN201
        hit = super().layer(index, device, tp, micro_batch)
        if hit is None:
            return None
        cost, sol = hit
        t = self.terms(index, device, tp, micro_batch)
        if not t.num_attention:
            return hit
        return with_terms(cost, t), sol


def with_terms(cost: LayerCost, t: cpx.CPTerms) -> LayerCost:
    """``cost`` with the context-parallel terms ``t`` added (module docstring)."""
    alt = cost.activation_bytes_alt
    return dataclasses.replace(
        cost,
        forward_s=cost.forward_s + t.extra_forward_s + t.gather_s,
        backward_s=cost.backward_s + t.extra_backward_s + t.scatter_s,
        comm_s=cost.comm_s + t.comm_s,
        activation_bytes=cost.activation_bytes + t.extra_saved_bytes,
        activation_bytes_alt=None if alt is None else alt + t.extra_saved_bytes,  # the autocast program's (stage_cost)
    )
