"""This machine's verify kernels, as the CLI's `kernels` and the Profile page show them: per
weight shape and row count, the kernel the target reads through — the row-invariant kernels
(runtime/kernels/rowdot.py) or the one the probe chose (runtime/kernels/probe.py) — each candidate's time
and the kernel's ratio to stock. Torch-free at import."""
from __future__ import annotations


def kernel_report(pair) -> dict:
    """{cpu, threads, torch, kernel_set, rows, note}: `rows` empty (and `note` why) where the
    target's verify reads are not on probed kernels (a pinned tier, a forced kernel, a GPU)."""
    from engine.runtime.kernels import rowdot
    from engine.runtime.kernels.probe import cpu_name, table_of

    if rowdot.converted(pair.target)[0]:  # the row-invariant kernels: the tier's only exact ones, timed here
        import torch

        return dict(cpu=cpu_name(), threads=torch.get_num_threads(), torch=torch.__version__,
                    kernel_set=pair.kernel_set, rows=rowdot.timings(pair.target),
                    note="every read through the row-invariant kernels (exact at every row count); "
                         "stock: torch's linear at the tier's float weights")
    table = table_of(pair.target)
    if table is None:
        why = ("verify reads pinned to one-token steps" if pair.exact_verify
               else f"every read through {pair.kernel_set} ($SPECLAB_KERNELS)" if pair.kernel_set
               else "no few-row kernels apply on this device and tier")
        return dict(cpu=cpu_name(), threads=None, torch=None, kernel_set=pair.kernel_set or None, rows=[], note=why)
    m = table.machine
    return dict(cpu=m.cpu, threads=m.threads, torch=m.torch, kernel_set=table.kernel_set, rows=table.rows(), note="")
