"""Source Feature Collector (Ampomah et al. 2020, §4; thesis §3.2).

Gathers ``F^s = [f_1, ..., f_n]``, the outputs of the top n encoder layers,
bottom to top: ``f_i = H_e^{L-n+i}``, so ``f_n = H_e^L``. The embedding output is
never collected (1 <= n <= L).
"""

from typing import List, Optional

import torch
from fairseq.modules import LayerNorm
from torch import Tensor, nn


class SourceFeatureCollector(nn.Module):
    """Stack the top-n encoder layer outputs into taps ``n x T x B x C``.

    Post-norm (the paper's equations): encoder layer outputs are already
    normalised and are used as they are.
    Pre-norm (the authors' released code [code]): fairseq's encoder states are
    not normalised (only the top one passes the encoder's final LayerNorm), so ``f_i = LN_i(H_e^{L-n+i})`` with n-1 own
    LayerNorms; the top tap is fairseq's ``encoder_out``, normalised by the
    encoder's own final LayerNorm, so that n = 1 is exactly the baseline.

    ``zeroed_layer``: an encoder layer number l (1..L) whose tap is replaced by
    zeros after its LayerNorm (the encoder-layer masking ablation: thesis §3.5.4, Table 3.5;
    Ampomah et al. 2020, §7.4, Table 7; zeroing after the LayerNorm is this package's reading).
    """

    def __init__(self, num_taps: int, embed_dim: int, normalize_before: bool,
                 zeroed_layer: Optional[int] = None):
        super().__init__()
        if num_taps < 1:
            raise ValueError(f"the number of taps n must be >= 1, got {num_taps}")
        self.num_taps = num_taps
        self.normalize_before = normalize_before
        num_norms = num_taps - 1 if normalize_before else 0
        self.layer_norms = nn.ModuleList(LayerNorm(embed_dim) for _ in range(num_norms))
        self.zeroed_layer = zeroed_layer

    def forward(self, encoder_states: List[Tensor], encoder_out: Tensor) -> Tensor:
        """Return ``F^s`` as ``n x T x B x C``, bottom to top.

        ``encoder_states``: fairseq's ``[embedding_output, layer_1, ..., layer_L]``,
        each T x B x C; ``encoder_out``: the final (normalised in pre-norm)
        encoder output T x B x C, used as ``f_n``.
        """
        num_layers = len(encoder_states) - 1  # index 0 is the embedding output
        if not 1 <= self.num_taps <= num_layers:
            raise ValueError(
                f"cannot collect the top {self.num_taps} layers of a "
                f"{num_layers}-layer encoder (need 1 <= n <= L)"
            )
        lower = encoder_states[num_layers - self.num_taps + 1 : num_layers]
        if self.normalize_before:
            lower = [norm(state) for norm, state in zip(self.layer_norms, lower)]
        taps = list(lower) + [encoder_out]
        if self.zeroed_layer is not None:
            index = self._tap_index(self.zeroed_layer, num_layers)
            taps[index] = torch.zeros_like(taps[index])
        return torch.stack(taps, dim=0)

    def _tap_index(self, layer: int, num_layers: int) -> int:
        """Tap index (0..n-1) of encoder layer ``layer`` (1..L)."""
        first = num_layers - self.num_taps + 1
        if not first <= layer <= num_layers:
            raise ValueError(
                f"zeroed_layer {layer} is not collected: the taps are encoder "
                f"layers {first}..{num_layers}"
            )
        return layer - first
