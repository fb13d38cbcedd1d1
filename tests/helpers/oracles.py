"""The one rotation oracle of the suite: each channel pair turned by an explicit 2x2 matrix, in float64.

Independent of posenc's code: no table, no `rotate_half`, one pair at a time. Tests build their angles
(or cos/sin) their own way and pass them here.
"""

import torch


def pair_channels(pairing: str, r: int, j: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(read channels, write channels) of rotation pair j among `r` rotary channels.

    split_half pairs (j, j + r/2); interleaved pairs (2j, 2j + 1); interleaved_to_split_half (DeepSeek)
    reads (2j, 2j + 1) and writes (j, j + r/2).
    """
    if pairing == "split_half":
        return (j, j + r // 2), (j, j + r // 2)
    if pairing == "interleaved":
        return (2 * j, 2 * j + 1), (2 * j, 2 * j + 1)
    if pairing == "interleaved_to_split_half":
        return (2 * j, 2 * j + 1), (j, j + r // 2)
    raise ValueError(f"unknown pairing {pairing!r}")


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str = "split_half") -> torch.Tensor:
    """float64 `x [..., d]` with pair j multiplied by `[[cos_j, -sin_j], [sin_j, cos_j]]`.

    Args:
        x: `[..., d]`; channels from r = 2 * cos.shape[-1] on pass through unchanged.
        cos, sin: `[..., r/2]`, broadcastable against `x[..., 0]` on the leading axes.
        pairing: "split_half", "interleaved" or "interleaved_to_split_half".
    Returns:
        float64 tensor of the broadcast shape `[..., d]`.
    """
    x64, cos, sin = x.double(), cos.double(), sin.double()
    r = 2 * cos.shape[-1]
    shape = torch.broadcast_shapes(x64.shape[:-1], cos.shape[:-1])
    out = x64.expand(*shape, x64.shape[-1]).clone()
    for j in range(r // 2):
        c, s = cos[..., j], sin[..., j]
        matrix = torch.stack((torch.stack((c, -s), -1), torch.stack((s, c), -1)), -2)  # [..., 2, 2]
        (a, b), (write_a, write_b) = pair_channels(pairing, r, j)
        vector = torch.stack((x64[..., a], x64[..., b]), -1)[..., None]  # [..., 2, 1]
        turned = (matrix @ vector)[..., 0]  # [..., 2]
        out[..., write_a], out[..., write_b] = turned[..., 0], turned[..., 1]
    return out


def rotate_angles(x: torch.Tensor, angles: torch.Tensor, pairing: str = "split_half", scale: float = 1.0) -> torch.Tensor:
    """`rotate_pairs` with cos and sin of float64 `angles [..., r/2]`, both multiplied by `scale`."""
    angles = angles.double()
    return rotate_pairs(x, angles.cos() * scale, angles.sin() * scale, pairing)
