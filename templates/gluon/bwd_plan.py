"""``GluonBackwardPlan``: the Gluon backward's two launches (preprocess, main) kept for the next
call laid out alike, each through a ``DirectLaunch``.

``bwd_kernel.launch_plan`` builds a new ``LaunchPlan`` (or ``WsLaunchPlan``) on every call,
makes eight or nine TMA descriptors and launches both kernels through Triton's JIT, whose
binder specializes each argument again: host time per backward that a training step at 4k
tokens spends waiting on Python (H200 host: the entry points' forward + backward took
1.0-1.5 ms of host time against 0.74 ms of kernels). This plan wraps one of those launch plans
(its grids, options, scalars and descriptors' layouts, worked out once) and per call only
allocates the buffers, makes the descriptors from the kept ones (``PlannedDescriptor``) and
launches.

What the wrapped plan fixes, and so what its key must hold (``gluon_attention_bwd``'s plan
cache): shapes, strides, dtypes and devices of the inputs, the causal mode, scale and config,
and a block mask's geometry; the mask's tensors are each call's own. Pointers are specialized
on 16-byte alignment: a call whose plain pointers (o, do, lse, the row buffers, dq_accum,
the mask's lists) are all aligned takes the direct launches, any other the JIT's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from templates.compile.direct_launch import DirectLaunch, PlannedDescriptor, current_stream
from templates.compile.launch_device import LaunchDevice
from templates.masks.row_ranges import row_first_keys

__all__ = ["GluonBackwardPlan"]

_MASK_TENSORS = 6  # a BlockMask's tensors in its ``kernel_args``


def _split_options(fn: Any, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(constexprs, launch options) of ``fn``'s launch with ``options``: every constexpr
    parameter (they follow the runtime ones), with its default where ``options`` leaves it
    out (a ``DirectLaunch`` passes all of them to the compiled launcher), and the options
    Triton takes at launch (a Gluon kernel's num_warps is both)."""
    params = [p for p in getattr(fn, "params", ()) if p.is_constexpr]
    if params:
        constexprs = {p.name: options.get(p.name, p.default) for p in params}
    else:  # an interpreted kernel or a stand-in (tests): the options it names
        names = set(getattr(fn, "arg_names", ()))
        constexprs = {k: v for k, v in options.items() if k in names}
    launch = {k: v for k, v in options.items() if k not in constexprs or k == "num_warps"}
    return constexprs, launch


class GluonBackwardPlan:
    """One backward of the Gluon kernels less its tensors: ``plan`` is the module's
    ``LaunchPlan`` or ``WsLaunchPlan`` made from the first call's (TMA-ready) inputs,
    ``module`` its kernel module (``bwd_kernel`` or ``bwd_ws_kernel``), ``preprocess`` the
    preprocess kernel. ``copy_inputs``/``copy_o``: the call's layouts need contiguous copies
    before TMA (``tma_ready``), as ``launch_plan`` makes them."""

    def __init__(self, plan: Any, preprocess: Any, *, warp_specialized: bool,
                 copy_inputs: bool = False, copy_o: bool = False) -> None:
        self.plan = plan
        self.warp_specialized = warp_specialized
        self.sparse = getattr(plan, "mask_args", None) is not None
        # (doc_offsets) each call's rows' document starts go where the partial tiles go.
        self.docs = bool(getattr(plan, "options", {}).get("DOCS"))
        self.copy_inputs = copy_inputs
        self.copy_o = copy_o
        # The kept plan must not hold the first call's mask alive: its tensors are each
        # call's own (``mask_tail``); the strides stay.
        self.mask_strides: list[Any] = list(plan.mask_args[_MASK_TENSORS:]) if self.sparse else []
        if self.sparse:
            plan.mask_args = [None] * _MASK_TENSORS + self.mask_strides
        pre_options = plan.preprocess_options()
        self.preprocess = DirectLaunch(preprocess, plan.pre_grid,
                                       *_split_options(preprocess, pre_options))
        self.pre_options = pre_options
        q_desc = functools.partial(_descriptor, block=plan.q_block, layout=plan.q_layout)
        kv_desc = functools.partial(_descriptor, block=plan.kv_block, layout=plan.kv_layout)
        makers: list[Any] = [q_desc, kv_desc, kv_desc, q_desc, kv_desc, kv_desc,
                             plan._rows_descriptor, plan._rows_descriptor]
        # The accumulator goes as a TMA descriptor to the warp-specialized kernels' dQ warp;
        # as a plain pointer where the MMA warps add dQ themselves (the d256 kernel's
        # dq_buffers 0: ``dq_by_descriptor`` False).
        self.dq_descriptor = warp_specialized and getattr(plan, "dq_by_descriptor", True)
        if self.dq_descriptor:
            makers.append(plan._dq_descriptor)
        # dq made from the accumulator (row-major, or D-major with dq_transposed) by a
        # launch of its own, in q's layout.
        cast = plan.dq_cast_kernel()
        self.dq_cast = DirectLaunch(cast, plan.dq_cast_grid,
                                    *_split_options(cast, plan.dq_cast_options))
        self.main_fn = plan.main_kernel()
        self.main = DirectLaunch(self.main_fn, plan.grid,
                                 *_split_options(self.main_fn, plan.options),
                                 {i: PlannedDescriptor(make) for i, make in enumerate(makers)})
        self._device = LaunchDevice()

    def __call__(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, block_mask: Any = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.sparse != (block_mask is not None):
            raise ValueError("this backward plan was made " + (
                "for a block mask: pass one" if self.sparse else "without a block mask"))
        given_q = q  # (dq is laid out as it, not as a copy for TMA)
        if self.copy_inputs:
            from templates.gluon.common import tma_ready
            q, k, v, do = tma_ready(q), tma_ready(k), tma_ready(v), tma_ready(do)
        if self.copy_o:
            o = o.contiguous()
        delta, lse2, dq_accum, dk, dv = self.plan.buffers(q, k, v)
        # A deterministic plan's dQ counters: zeroed for this call, like dq_accum (a counter
        # left by an earlier call would make the kernel wait for turns that never come).
        dq_counters = self.plan.dq_counters(q) if self.warp_specialized else None
        mask_tensors = (list(block_mask.transposed.kernel_args()[:_MASK_TENSORS])
                        if self.sparse else [lse2] * _MASK_TENSORS)
        if self.docs:
            mask_tensors[_MASK_TENSORS - 1] = row_first_keys(block_mask, self.plan.rows_pad)
        with self._device.of(q):
            self._launch(do, q, k, v, o, lse, delta, lse2, dq_accum, dk, dv, mask_tensors,
                         dq_counters, block_mask.transposed if self.sparse else None)
            return self._cast_dq(dq_accum, given_q), dk, dv

    def _cast_dq(self, dq_accum: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """dq in q's layout (``torch.empty_like(q)``) from the accumulator (the plan's
        ``dq_cast_kernel``, direct where it can be)."""
        dq = torch.empty_like(q)
        scalars = self.plan.dq_cast_scalars(dq)
        stream = current_stream(q.device.index) if q.is_cuda else 0
        if not (dq.data_ptr() % 16 == 0 and self.dq_cast.try_direct(
                stream, dq_accum.data_ptr(), dq.data_ptr(), *scalars)):
            self.dq_cast.launch_on(stream, dq_accum, dq, *scalars)
        return dq

    def _launch(self, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, delta: Any,
                lse2: Any, dq_accum: Any, dk: Any, dv: Any, mask_tensors: list[Any],
                dq_counters: Any = None, kv_major: Any = None) -> None:
        plan = self.plan
        pre_tail = plan.preprocess_args(o, do, lse, delta, lse2, dq_accum)[6:]
        main_head = [q, k, v, do, dk, dv, lse2, delta]
        # The warp-specialized kernel's last runtime argument: the dQ counters, or None (a
        # constexpr: the default kernel compiles it out).
        # ... then the plan's own (the split kernel's schedule and tile count).
        extra = plan.tail_args(dk, mask_tensors, kv_major) if self.warp_specialized else []
        strides = self.mask_strides or [0] * 5
        mask_tail = [*mask_tensors, *strides, dq_counters, *extra] \
            if self.warp_specialized else []
        pointers = [t.data_ptr() for t in (o, do, lse, delta, lse2, dq_accum, *mask_tensors)]
        aligned = all(p % 16 == 0 for p in pointers)
        stream = current_stream(q.device.index) if q.is_cuda else 0
        o_ptr, do_ptr, lse_ptr, delta_ptr, lse2_ptr, dq_ptr = pointers[:6]
        # dq_accum: the non-specialized kernel's plain pointer, the other's TMA descriptor.
        dq_arg = dq_accum if self.dq_descriptor else dq_ptr
        if not (aligned and self.preprocess.try_direct(
                stream, o_ptr, do_ptr, lse_ptr, delta_ptr, lse2_ptr, dq_ptr, *pre_tail)):
            if aligned:
                self.preprocess.launch_on(stream, o, do, lse, delta, lse2, dq_accum,
                                          *pre_tail)
            else:
                self.preprocess.kernel[plan.pre_grid](o, do, lse, delta, lse2, dq_accum,
                                                      *pre_tail, **self.pre_options)
        # The counters (torch's allocation: 16-byte aligned, as the compiled kernel assumes)
        # go as their address, or None.
        counters_ptr = None if dq_counters is None else dq_counters.data_ptr()
        extra_direct = [x.data_ptr() if isinstance(x, torch.Tensor) else x for x in extra]
        direct_tail = ([*pointers[6:], *strides, counters_ptr, *extra_direct] if mask_tail
                       else [])
        if aligned and self.main.try_direct(stream, *main_head, dq_arg, *plan.scalars,
                                            *direct_tail):
            return
        if aligned:
            self.main.launch_on(stream, *main_head, dq_accum, *plan.scalars, *mask_tail)
        else:
            self.main_fn[plan.grid](*plan.main_args(q, k, v, do, dk, dv, dq_accum, lse2, delta)[:9],
                                    *plan.scalars, *mask_tail, **plan.options)


def _descriptor(t: Any, block: list[int], layout: Any) -> Any:
    from templates.gluon.common import tma_descriptor
    return tma_descriptor(t, block, layout)
