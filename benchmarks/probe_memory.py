"""Compiled memory of a training step sowing full logits vs the logits probe.

For each size, the forward + loss + gradient step of the reference model is
lowered and compiled (nothing is run) twice -- sowing the raw tensors
(``use_probes=False``: a ``[B, T, V]`` logits tensor) and sowing the probes
(``use_probes=True``: a ``LogitsSummary``, ~20 scalars + a ``[B, T]`` argmax) --
in two settings:

- ``metrics in step``: ``activation_metrics`` runs inside the step and only the
  metric scalars leave it (the recommended loop);
- ``sown out``: the step returns the sown intermediates (metrics computed later).

XLA's ``compiled.memory_analysis()`` gives the temporary and output buffer sizes.
Attention-logit sowing is off in both, so the logits are the difference.

Run: ``python benchmarks/probe_memory.py [--sizes 8x256x32768,4x512x65536]``
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from jvitals.metrics.activations import activation_metrics
from jvitals.reference_model import ModelConfig, init_params, loss_fn


def _compiled_memory(cfg: ModelConfig, b: int, t: int, in_step: bool) -> tuple[int, int]:
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    batch = dict(tokens=jax.ShapeDtypeStruct((b, t), jnp.int32),
                 labels=jax.ShapeDtypeStruct((b, t), jnp.int32),
                 mask=jax.ShapeDtypeStruct((b, t), jnp.bool_))

    def step(params, batch):
        (loss, inter), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, cfg)
        if in_step:
            return loss, grads, activation_metrics(inter, mask=batch["mask"], labels=batch["labels"])
        return loss, grads, inter

    mem = jax.jit(step).lower(params, batch).compile().memory_analysis()
    return int(mem.temp_size_in_bytes), int(mem.output_size_in_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8x256x32768,4x512x65536", help="BxTxV,...")
    args = ap.parse_args()
    mib = 2.0 ** 20
    print(f"{'B x T x V':>18} {'setting':>16} {'raw temp':>10} {'raw out':>10} {'probe temp':>11} "
          f"{'probe out':>10} {'raw/probe (temp+out)':>21}")
    for size in args.sizes.split(","):
        b, t, v = (int(x) for x in size.split("x"))
        base = ModelConfig(vocab=v, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                           d_ff=128, sow_attn_logits=False)
        for in_step in (True, False):
            raw = _compiled_memory(dataclasses.replace(base, use_probes=False), b, t, in_step)
            probe = _compiled_memory(dataclasses.replace(base, use_probes=True), b, t, in_step)
            ratio = sum(raw) / max(sum(probe), 1)
            print(f"{size:>18} {'metrics in step' if in_step else 'sown out':>16} {raw[0] / mib:>9.1f}M "
                  f"{raw[1] / mib:>9.1f}M {probe[0] / mib:>10.1f}M {probe[1] / mib:>9.1f}M {ratio:>20.2f}x")


if __name__ == "__main__":
    main()
