"""Write the TF checkpoint format fixtures with TensorFlow itself (tests/data/tf-checkpoints/format/).

    /opt/tfvenv/bin/python tests/data/make_tf_checkpoints.py     # TensorFlow 2.21 (tensorflow-cpu)

Writes, with tf.compat.v1.train.Saver in graph mode:
  v2/model.ckpt-7.{index,data-00000-of-00001} and v2/checkpoint   the V2 bundle (Saver's default)
  v1/model.ckpt-7 and v1/checkpoint                                the V1 table (write_version=V1)
  v2-partitioned/...                                               V2 with the partitioned variable too
  expected.npz                                                     every variable's value, by name
The variables cover what the seeds' checkpoints hold: a float32 global_step (the Inception seed's), an
int64 step (the ResNet seed's), a 4-D HWIO conv kernel, vectors, an ExponentialMovingAverage shadow,
float64, float16, int32, bool, and (V1 only, which the V1 reader assembles) a variable partitioned
into two slices. Values are random but fixed (seed 0), so a rerun writes the same files.
Run only to regenerate the fixtures: TensorFlow is never a test dependency.
"""

import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

OUT = Path(__file__).resolve().parent / "tf-checkpoints" / "format"


def values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "global_step": np.array(7.0, np.float32),
        "resnet/global_step64": np.array(123456789012, np.int64),
        "conv0/weights": rng.standard_normal((3, 3, 2, 4)).astype(np.float32),
        "conv0/BatchNorm/beta": rng.standard_normal(4).astype(np.float32),
        "conv0/weights/ExponentialMovingAverage": rng.standard_normal((3, 3, 2, 4)).astype(np.float32),
        "dense/kernel": rng.standard_normal((4, 5)).astype(np.float32),
        "float64/value": rng.standard_normal((2, 3)).astype(np.float64),
        "float16/value": rng.standard_normal(3).astype(np.float16),
        "int32/value": np.arange(-3, 3, dtype=np.int32).reshape(2, 3),
        "bool/value": np.array([True, False, True]),
    }


def write(version: str) -> dict[str, np.ndarray]:
    tf.compat.v1.reset_default_graph()
    expected = values()
    with tf.Graph().as_default():
        for name, value in expected.items():
            tf.compat.v1.get_variable(name, initializer=tf.constant(value), use_resource=False)
        if version in ("v1", "v2-partitioned"):
            parted = np.arange(12, dtype=np.float32).reshape(6, 2) / 4
            tf.compat.v1.get_variable(
                "partitioned/weights",
                initializer=tf.constant(parted),
                partitioner=tf.compat.v1.fixed_size_partitioner(2),
                use_resource=False,
            )
            expected["partitioned/weights"] = parted
        saver_def = tf.compat.v1.train.SaverDef
        write_version = saver_def.V1 if version == "v1" else saver_def.V2
        saver = tf.compat.v1.train.Saver(write_version=write_version)
        directory = OUT / version
        directory.mkdir(parents=True, exist_ok=True)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, str(directory / "model.ckpt"), global_step=7, write_meta_graph=False)
    # The checkpoint file names the prefix by absolute path; a relative one (what TF writes when the
    # directory is given relative) keeps the fixture movable.
    (OUT / version / "checkpoint").write_text(
        'model_checkpoint_path: "model.ckpt-7"\nall_model_checkpoint_paths: "model.ckpt-7"\n'
    )
    return expected


def main() -> int:
    tf.compat.v1.disable_eager_execution()
    v2 = write("v2")
    v1 = write("v1")
    write("v2-partitioned")  # fasttrain refuses V2 partitioned variables: a test of that error
    np.savez(OUT / "expected.npz", **{k.replace("/", "|"): v for k, v in {**v2, **v1}.items()})
    reader = tf.train.load_checkpoint(str(OUT / "v1" / "model.ckpt-7"))
    for name, value in v1.items():
        try:
            assert np.array_equal(reader.get_tensor(name), value), name
        except tf.errors.UnimplementedError as exc:  # TF's V1 reader lacks some dtypes it writes
            print(
                f"TensorFlow cannot read back {name} ({value.dtype}) from V1: {exc.message}", file=sys.stderr
            )
    print(f"wrote {OUT} with TensorFlow {tf.__version__}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
