"""Checks by hand that the Inception seed's own TF graph restores what `fasttrain.tf.convert to-tf` writes.

    /opt/tfvenv/bin/python tests/data/check_tf_restore_inception.py PREFIX [PREFIX_TO_COMPARE]

Builds the seed's training graph of the REDUCED model (tests/data/tf_ports/inception_v3.py through
make_tf_inception.build_train_graph: RMSProp slots, ExponentialMovingAverage shadows of the trainable
variables and the BN moving statistics, the zero-debias state of each moving statistic, float32
global_step) and restores PREFIX with a plain `tf.compat.v1.train.Saver()` over every global variable,
as the seed's --checkpoint_dir restore does: a variable missing from PREFIX is TF's NotFoundError, a
wrong shape or dtype its InvalidArgumentError. Then it runs one step of the seed's train op on
make_tf_inception.images(1)/labels(1) and prints its losses. With PREFIX_TO_COMPARE (e.g. the fixture
reduced/model.ckpt-7), prints the largest difference of each kind of variable between the two.
TensorFlow stays out of the tests: this is a check to run by hand (it takes ~1 minute).
"""

import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).parent))
import make_tf_inception as fixture  # noqa: E402

v1 = tf.compat.v1


def _kind(name: str) -> str:
    for suffix in ("/ExponentialMovingAverage", "/RMSProp_1", "/RMSProp", "/biased", "/local_step"):
        if name.endswith(suffix):
            return name.rsplit("/", 2)[-2] + suffix if suffix == "/ExponentialMovingAverage" else suffix[1:]
    return name.rsplit("/", 1)[-1]


def main(prefix: str, compare: str = "") -> None:
    v1.disable_eager_execution()
    with tf.Graph().as_default():
        x, y, global_step, _, parts, op = fixture.build_train_graph(
            fixture.DEPTH, fixture.CLASSES, fixture.BATCH
        )
        variables = v1.global_variables()
        with fixture.session() as sess:
            v1.train.Saver(variables).restore(sess, prefix)
            print(f"restored all {len(variables)} global variables of the seed's graph from {prefix}")
            values = sess.run({v.op.name: v for v in variables})
            print("global_step", values["global_step"], values["global_step"].dtype)
            feed = {x: fixture.images(1), y: fixture.labels(1)}
            losses = sess.run(parts, feed)
            sess.run(op, feed)
            print(
                "one train step:",
                {k: float(v) for k, v in losses.items()},
                "-> global_step",
                sess.run(global_step),
            )
    if compare:
        reader = tf.train.load_checkpoint(compare)
        worst = {}
        for name, value in values.items():
            other = reader.get_tensor(name)
            scale = max(float(np.abs(other).max()), 1e-12)
            diff = float(np.abs(np.asarray(value, np.float64) - other).max()) / scale
            worst[_kind(name)] = max(worst.get(_kind(name), 0.0), diff)
        print(f"largest difference from {compare}, relative to each variable's scale, by kind:")
        for kind, diff in sorted(worst.items()):
            print(f"  {kind:40s} {diff:.3g}")


if __name__ == "__main__":
    main(*sys.argv[1:])
