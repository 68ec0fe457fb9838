"""Bytes on the wire: the cost model behind every byte counter of this package (comm/grad_bytes).

Bytes are counted as what one rank puts on the wire under the usual cost model of each collective (NCCL's ring /
pairwise algorithms): all-reduce of B bytes over n ranks 2(n-1)/n*B, all-to-all (n-1)/n*B, all-gather of b bytes per
rank (n-1)*b. That is the quantity compression shrinks; it is not what a profiler sees on a particular topology.
"""


def allreduce_bytes(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes
