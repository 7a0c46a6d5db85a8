"""Write the TF checkpoint fixtures of the reader's edge cases with TensorFlow itself
(tests/data/tf-checkpoints/extra/).

    /tmp/tfvenv/bin/python tests/data/make_tf_checkpoints_extra.py     # TensorFlow 2.21 (tensorflow-cpu)

Writes, with tf.compat.v1.train.Saver in graph mode, the variables of make_tf_checkpoints.values():
  v1-sharded/model.ckpt-7-0000{0,1}-of-00002 and checkpoint   V1, sharded=True over two CPU devices: the
                                                              `checkpoint` file names the prefix as TF
                                                              does, "model.ckpt-7-?????-of-00002"
  v2-string/..., v1-string/...                                V2 and V1 with string variables besides
                                                              (a scalar run_note and a vector tags)
  v1-uint16/model.ckpt-7                                      V1 with a uint16 variable (TF stores it in
                                                              TensorProto.int_val; TF 2.21's own V1
                                                              reader cannot read it back: "Data type not
                                                              supported")
  expected.npz                                                every numeric variable's value, by name
Run only to regenerate the fixtures: TensorFlow is never a test dependency.
"""

import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tf_checkpoints import values  # noqa: E402

OUT = Path(__file__).resolve().parent / "tf-checkpoints" / "extra"
UINT16 = np.array([0, 1, 40000, 65535], np.uint16)


def write(name: str, version: str, *, sharded: bool = False, strings: bool = False, uint16=False) -> None:
    expected = values()
    with tf.Graph().as_default():
        variables = []
        for i, (n, value) in enumerate(expected.items()):
            with tf.device(f"/cpu:{i % 2}" if sharded else "/cpu:0"):
                variables.append(
                    tf.compat.v1.get_variable(n, initializer=tf.constant(value), use_resource=False)
                )
        if strings:
            for n, value in (("run_note", b"hello"), ("tags", [b"a", b"\x00b\xff", b""])):
                variables.append(
                    tf.compat.v1.get_variable(n, initializer=tf.constant(value), use_resource=False)
                )
        if uint16:
            variables.append(
                tf.compat.v1.get_variable("uint16/value", initializer=tf.constant(UINT16), use_resource=False)
            )
        saver_def = tf.compat.v1.train.SaverDef
        saver = tf.compat.v1.train.Saver(
            variables, sharded=sharded, write_version=saver_def.V1 if version == "v1" else saver_def.V2
        )
        directory = OUT / name
        directory.mkdir(parents=True, exist_ok=True)
        config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saved = saver.save(sess, str(directory / "model.ckpt"), global_step=7, write_meta_graph=False)
    # TF names the prefix by absolute path; the same name relative keeps the fixture movable.
    named = Path(saved).name
    (directory / "checkpoint").write_text(
        f'model_checkpoint_path: "{named}"\nall_model_checkpoint_paths: "{named}"\n'
    )
    reader = tf.train.load_checkpoint(str(directory))
    for n, value in expected.items():
        if n != "float16/value" or version == "v2":  # TF's V1 reader cannot read back float16
            assert np.array_equal(reader.get_tensor(n), value), n
    print(f"wrote {directory} ({saved})", file=sys.stderr)


def main() -> int:
    tf.compat.v1.disable_eager_execution()
    write("v1-sharded", "v1", sharded=True)
    write("v2-string", "v2", strings=True)
    write("v1-string", "v1", strings=True)
    write("v1-uint16", "v1", uint16=True)
    expected = {**values(), "uint16/value": UINT16}
    np.savez(OUT / "expected.npz", **{k.replace("/", "|"): v for k, v in expected.items()})
    print(f"wrote {OUT} with TensorFlow {tf.__version__}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
