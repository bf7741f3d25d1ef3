"""document_mask: packed documents' visibility, wherever the block mask evaluates it."""

from __future__ import annotations

import torch

from templates.masks.mods import document_mask


def test_a_mask_built_on_one_device_answers_indices_on_another() -> None:
    # Built with the default device (the CPU) and evaluated on indices elsewhere, as
    # BlockMask.from_mask_mod(..., device="cuda") does: it raised on the GPU ("indices should
    # be either on cpu or on the same device"). The meta device stands in for the GPU here.
    mod = document_mask([2, 3], causal=True)
    q, k = torch.arange(6)[:, None], torch.arange(6)[None, :]
    here = mod(None, None, q, k)
    elsewhere = mod(None, None, q.to("meta"), k.to("meta"))
    assert elsewhere.device.type == "meta" and elsewhere.shape == here.shape
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [0, 0, 1, 0, 0, 0],
                             [0, 0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 0, 0, 0]], dtype=torch.bool)  # row 5: past the documents
    assert torch.equal(here, expected)
