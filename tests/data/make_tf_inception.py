"""Writes tests/data/tf-inception/ with TensorFlow itself (run once: /opt/tfvenv/bin/python this file).

From the Inception seed's graph ported to tf.compat.v1 (tests/data/tf_ports/inception_v3.py):

  full_variables.json   every global variable of the seed's training graph at full size and 1001
                        classes (model, BN zero-debias state, EMA shadows, RMSProp slots, global_step):
                        [name, shape, dtype] in TF's creation order.
  reduced/model.ckpt-7  a V2 checkpoint (tf.compat.v1.train.Saver) of the REDUCED model (depth
                        multiplier 1/32, 11 classes) after 2 real training steps of the seed's train op
                        on a calibration batch, then global_step set to 7 and every EMA shadow moved
                        off its variable (shadow + 0.2 * std * noise), so raw and EMA logits differ.
  logits.npz            TF's eval-mode logits (is_training=False, as inception_eval.py) of the reduced
                        model on `images()` below: "raw" from the variables, "ema" from the shadows
                        restored through ExponentialMovingAverage.variables_to_restore() as
                        inception_eval.py restores them.

The committed fixture was written before the graph-level seed below was set: a rerun writes other
values, equally valid (the tests read whatever the files hold; rerun make_tf_step_inception.py too).

Inputs: images() is uniform noise from NumPy's legacy RandomState (a stream NumPy keeps stable),
scaled to [-1, 1] as the seed's preprocessing does; the tests rebuild it with the same code.
"""

import json
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).parent / "tf_ports"))
import inception_v3 as port  # noqa: E402

v1 = tf.compat.v1
OUT = Path(__file__).parent / "tf-inception"
DEPTH, CLASSES, BATCH = 1.0 / 32, 11, 4
DECAY_STEPS = 4  # the fixture's LR staircase: steps 7, 8, 9 cross a boundary (lr 0.016, 0.00256)
START_STEP = 7


def session():
    """A Session without Grappler: its rewrites took minutes on this graph and may fuse ops that
    the seed's TF ran separately; the ops run as the port wrote them."""
    rewrite = tf.compat.v1.ConfigProto().graph_options.rewrite_options
    rewrite.disable_meta_optimizer = True
    config = v1.ConfigProto()
    config.graph_options.rewrite_options.CopyFrom(rewrite)
    return v1.Session(config=config)


def images(seed: int) -> np.ndarray:
    """(BATCH, 299, 299, 3) float32 in [-1, 1]."""
    u8 = np.random.RandomState(seed).randint(0, 256, size=(BATCH, 299, 299, 3)).astype(np.uint8)
    return u8.astype(np.float32) / np.float32(127.5) - np.float32(1.0)


def labels(seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, CLASSES, size=BATCH).astype(np.int64)


def build_train_graph(depth, classes, batch, dropout_keep=1.0):
    """The seed's training graph; dropout off by default (the fixtures fix it off on both sides)."""
    x = v1.placeholder(tf.float32, [batch, 299, 299, 3])
    y = v1.placeholder(tf.int64, [batch])
    global_step = v1.get_variable("global_step", [], initializer=v1.constant_initializer(0), trainable=False)
    lr = v1.train.exponential_decay(0.1, global_step, DECAY_STEPS, 0.16, staircase=True)
    logits, aux = port.inception_v3(x, classes, True, depth, dropout_keep)
    parts = port.tower_loss(logits, aux, y, classes)
    op = port.train_op(parts["total_loss"], global_step, lr)
    return x, y, global_step, lr, parts, op


def write_full_size_names():
    with tf.Graph().as_default():
        build_train_graph(1.0, 1001, 1, dropout_keep=0.8)
        rows = [[v.op.name, v.shape.as_list(), v.dtype.base_dtype.name] for v in v1.global_variables()]
        trainable = sum(int(np.prod(v.shape.as_list())) for v in v1.trainable_variables())
    (OUT / "full_variables.json").write_text(
        json.dumps({"trainable_parameters": trainable, "variables": rows}, indent=0) + "\n"
    )
    print(len(rows), "variables,", trainable, "trainable parameters")


def write_reduced_checkpoint():
    rng = np.random.RandomState(5)
    with tf.Graph().as_default():
        v1.set_random_seed(5)
        x, y, global_step, _, _, op = build_train_graph(DEPTH, CLASSES, BATCH)
        with session() as sess:
            sess.run(v1.global_variables_initializer())
            # Non-trivial values where the seed initialises to 0 or to tiny weights.
            for v in v1.trainable_variables():
                name = v.op.name
                if name.endswith(("/beta", "/biases")):
                    v.load(0.1 * rng.randn(*v.shape.as_list()).astype(np.float32), sess)
                elif name.endswith("FC/weights") or name == "logits/logits/weights":
                    v.load(0.1 * rng.randn(*v.shape.as_list()).astype(np.float32), sess)
            for step in range(2):
                sess.run(op, {x: images(100 + step), y: labels(100 + step)})
                print("pre-step", step, flush=True)
            global_step.load(float(START_STEP), sess)
            shadows = [v for v in v1.global_variables() if v.op.name.endswith("/ExponentialMovingAverage")]
            for v, value in zip(shadows, sess.run(shadows)):
                noise = rng.randn(*value.shape).astype(np.float32)
                value = value + 0.2 * (value.std() + 1e-3) * noise
                v.load(np.abs(value) if "moving_variance" in v.op.name else value, sess)
            ckpt_dir = OUT / "reduced"
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            saver = v1.train.Saver(
                v1.global_variables(), write_version=v1.train.SaverDef.V2, save_relative_paths=True
            )
            saver.save(sess, str(ckpt_dir / "model.ckpt"), global_step=START_STEP, write_meta_graph=False)
    return str(ckpt_dir / f"model.ckpt-{START_STEP}")


def write_eval_logits(ckpt: str):
    out = {}
    for kind in ("raw", "ema"):
        with tf.Graph().as_default():
            x = v1.placeholder(tf.float32, [BATCH, 299, 299, 3])
            logits, _ = port.inception_v3(x, CLASSES, False, DEPTH)
            if kind == "raw":
                saver = v1.train.Saver()
            else:  # inception_eval.py: restore every averaged variable from its shadow
                ema = v1.train.ExponentialMovingAverage(port.MOVING_AVERAGE_DECAY)
                saver = v1.train.Saver(ema.variables_to_restore())
            with session() as sess:
                saver.restore(sess, ckpt)
                out[kind] = sess.run(logits, {x: images(0)})
    np.savez(OUT / "logits.npz", **out)
    print("logits raw", out["raw"][0, :4], "ema", out["ema"][0, :4])


if __name__ == "__main__":
    v1.disable_eager_execution()
    OUT.mkdir(exist_ok=True)
    write_full_size_names()
    write_eval_logits(write_reduced_checkpoint())
