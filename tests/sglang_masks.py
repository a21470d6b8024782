"""Test helper shared by the SGLang plugin tests: SGLang's FULL_MASK block of one verify request."""

import torch


def full_mask_from_parents(parents, L):
    """Bool [q, L + q]: prefix all visible; draft row i sees its ancestors and itself (parents[-1 root])."""
    q = len(parents)
    m = torch.zeros(q, L + q, dtype=torch.bool)
    m[:, :L] = True
    for i in range(q):
        j = i
        while j >= 0:
            m[i, L + j] = True
            j = parents[j]
    return m
