"""Writes ``checkpoints/`` here with an older jvitals (run it with that version first on
the path; see README.md): 6 steps of the reference model under that version's Rollback,
its checkpoint of step 5, and ``leaves.json``: each saved leaf's dtype, shape and SHA-256."""

import hashlib
import json
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jvitals as vitals
from jvitals import reference_model as rm

HERE = pathlib.Path(__file__).resolve().parent
CFG = rm.ModelConfig(vocab=64, d_model=32, n_layers=2)


def name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def main() -> None:
    assert "wt-old" in vitals.__file__ or len(sys.argv) > 1, f"an older jvitals expected, got {vitals.__file__}"
    tx = vitals.with_lr_scale(vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))))
    model = rm.Decoder(CFG)

    @jax.jit
    def train_step(state, batch):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["tokens"], mask=batch["mask"])
            return rm.cross_entropy(logits, batch["labels"], batch["mask"])
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"], vitals_layers=False)
        return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, loss

    params = rm.init_params(CFG, jax.random.key(0))
    state = {"step": jnp.zeros([], jnp.int32), "params": params, "opt_state": tx.init(params)}
    out = HERE / "checkpoints"
    shutil.rmtree(out, ignore_errors=True)
    monitor = vitals.Monitor()
    guard = vitals.Rollback(out, save_every=100, monitor=monitor)
    for step in range(6):
        state, loss = train_step(state, rm.make_batch(step, CFG, batch=4, seq=16))
        verdict = monitor.update(step, jax.device_get({"loss": loss, **vitals.recorded(state["opt_state"])}))
        if step == 5:
            assert guard.respond(step, state, verdict, step + 1) is state
    guard.close()
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    leaves = {name(p): [str(np.asarray(x).dtype), list(np.shape(x)),
                        hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()] for p, x in flat}
    (HERE / "leaves.json").write_text(json.dumps(leaves, indent=0, sort_keys=True) + "\n")
    print("wrote", out, len(leaves), "leaves")


if __name__ == "__main__":
    main()
