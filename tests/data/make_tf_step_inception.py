"""Writes tests/data/tf-inception/steps.npz: 3 training steps of the Inception seed, made by TensorFlow.

Run once after make_tf_inception.py (/opt/tfvenv/bin/python this file). The seed's training graph
(tests/data/tf_ports/inception_v3.py: _tower_loss's slim losses, RMSProp 0.9/0.9/1.0, the staircase
LR, BN moving-statistics updates, ExponentialMovingAverage(0.9999, num_updates=global_step) of the
trainable and moving-average variables) on the reduced model, restored from reduced/model.ckpt-7,
dropout off, fed one fixed batch (make_tf_inception.images(1), labels(1)) three times.

Keys, for k = 1, 2, 3:
  step{k}/loss/{cross_entropy, aux_loss, regularization, total_loss}   the step's losses (before
                                  its update; aux_loss is already x0.4, regularization sum 4e-5 * l2)
  step{k}/lr                      the LR the step applied
  step{k}/values                  every global variable after the step (weights, beta, moving
                                  statistics, zero-debias state, EMA shadows, RMSProp slots, global_step),
                                  flattened and concatenated in the order of `names` (one entry per
                                  step keeps the file small: an .npz entry costs ~300 bytes itself)
  names, shapes                   the variables' names and shapes (JSON lists)
The losses are fetched in a run of their own before the train op: in one run with it, a read of a
variable for the loss may come after that variable's update (nothing orders them).
"""

import json
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).parent))
import make_tf_inception as fixture  # noqa: E402

v1 = tf.compat.v1


def main():
    v1.disable_eager_execution()
    out = {}
    with tf.Graph().as_default():
        x, y, _, lr, parts, op = fixture.build_train_graph(fixture.DEPTH, fixture.CLASSES, fixture.BATCH)
        feed = {x: fixture.images(1), y: fixture.labels(1)}
        with fixture.session() as sess:
            v1.train.Saver().restore(sess, str(fixture.OUT / "reduced" / f"model.ckpt-{fixture.START_STEP}"))
            for k in (1, 2, 3):
                losses, lr_value = sess.run([parts, lr], feed)
                sess.run(op, feed)
                out.update({f"step{k}/loss/{name}": value for name, value in losses.items()})
                out[f"step{k}/lr"] = lr_value
                variables = v1.global_variables()
                state = sess.run(variables)  # one run: one executor
                out[f"step{k}/values"] = np.concatenate([np.ravel(a).astype(np.float32) for a in state])
                out["names"] = np.array(json.dumps([v.op.name for v in variables]))
                out["shapes"] = np.array(json.dumps([list(np.shape(a)) for a in state]))
                print(k, {n: float(v) for n, v in losses.items()}, lr_value, flush=True)
    np.savez(fixture.OUT / "steps.npz", **out)


if __name__ == "__main__":
    main()
