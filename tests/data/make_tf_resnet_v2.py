"""Writes tests/data/tf-resnet-v2/: what TensorFlow makes of the ResNet seed's model. Run once, in a
scratch environment (never a dependency of the tests), from the repository root:

    TF_ENABLE_ONEDNN_OPTS=0 /opt/tfvenv/bin/python tests/data/make_tf_resnet_v2.py   # tensorflow-cpu 2.21

The graph is the seed's resnet_model.py ported to tf.compat.v1 (tests/data/tf_ports/resnet_v2.py, names
exactly the seed's), built under variable_scope("resnet") with 1001 classes as imagenet_main.py does.
Deterministic: graph-level seed 0 for TF's initialisers, a seeded numpy Generator for everything else.

- variables.json: for each resnet_size in 18, 34, 50, 101, 152, 200 at base width 64: every global
  variable of the graph in creation order as [name (no ':0'), shape, trainable], and the number of
  trainable parameters (sum of the trainable variables' sizes), as TF counts them.
- images.npz: "images", (3, 224, 224, 3) uint8 central crops of skimage.data astronaut, coffee and
  chelsea. The network input is the seed's vgg_preprocessing on the [0, 1] scale, in float32 numpy:
  x = u8 / 255 - (123.68, 116.78, 103.94) / 255 (`network_input` below; the tests repeat it).
- resnet50_v2_w2/ and resnet18_v2_w4/: reduced models (base width 2 and 4, every layer kind kept,
  1001 classes) written by tf.compat.v1.train.Saver as V2 checkpoints `model.ckpt-0` (no meta graph;
  with an Estimator's global_step = 0; the `checkpoint` file names it relatively), and <same>.npz with
  the same values under the same names (TF layouts: conv HWIO, dense (in, out)) plus
  "logits_eval" (is_training=False) and "logits_train" (is_training=True, the batch statistics) for
  the three images. Values: TF's initialisers for conv and dense kernels; BN gamma
  U(0.6, 1.4), beta N(0, 0.2), dense bias N(0, 0.1); moving statistics from one training-mode pass over
  the images (each layer's batch mean plus 0.2 batch std times N(0, 1), batch variance times U(0.7, 1.4)),
  so that eval-mode activations stay in range and every statistic matters.
- maxpool.npz: tf.nn.max_pool2d(x, 3, 2, "SAME") of N(0, 1) inputs (1, H, W, 2) for (H, W) in
  (16, 16), (15, 15), (8, 7), (2, 1): "x_HxW" and "y_HxW"
  (the parities that decide the padding; the logits cover 112 px).
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf
from skimage import data as skdata

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tf_ports"))
import resnet_v2 as port  # noqa: E402

v1 = tf.compat.v1
v1.disable_eager_execution()

OUT = os.path.join(os.path.dirname(__file__), "tf-resnet-v2")
NUM_CLASSES = 1001
MEANS = (123.68, 116.78, 103.94)  # vgg_preprocessing _R_MEAN, _G_MEAN, _B_MEAN
REDUCED = (("resnet50_v2_w2", 50, 2), ("resnet18_v2_w4", 18, 4))


def network_input(images_u8):
    return images_u8.astype(np.float32) / np.float32(255) - np.array(MEANS, np.float32) / np.float32(255)


def crops():
    out = []
    for name in ("astronaut", "coffee", "chelsea"):
        img = getattr(skdata, name)()
        top, left = (img.shape[0] - 224) // 2, (img.shape[1] - 224) // 2
        out.append(img[top : top + 224, left : left + 224, :3])
    return np.stack(out).astype(np.uint8)


def build(size, base, is_training, batch=None):
    """(graph, input placeholder, logits, BN batch stats) of the seed's model."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(0)
        v1.train.get_or_create_global_step()
        x = v1.placeholder(tf.float32, [batch, 224, 224, 3])
        stats = []
        with v1.variable_scope("resnet"):
            logits = port.imagenet_resnet_v2(size, NUM_CLASSES, x, is_training, base, stats)
    return graph, x, logits, stats


def bare(name):
    return name[: -len(":0")]


def write_variable_lists():
    lists = {}
    for size in port.MODEL_PARAMS:
        graph, _, _, _ = build(size, 64, is_training=False)
        with graph.as_default():
            trainable = {v.name for v in v1.trainable_variables()}
            variables = [
                [bare(v.name), v.shape.as_list(), v.name in trainable]
                for v in v1.global_variables()
                if v.name != "global_step:0"
            ]
        count = sum(int(np.prod(shape)) for _, shape, t in variables if t)
        lists[str(size)] = {"trainable_parameters": count, "variables": variables}
        print(f"resnet{size}_v2: {len(variables)} variables, {count:,} trainable parameters")
    with open(os.path.join(OUT, "variables.json"), "w") as f:
        json.dump(lists, f, separators=(",", ":"))


def assign_all(sess, graph, values):
    with graph.as_default():
        for v in v1.global_variables():
            if bare(v.name) in values:
                v.load(values[bare(v.name)], sess)


def write_reduced(images_u8, rng):
    x_in = network_input(images_u8)
    for tag, size, base in REDUCED:
        graph, x, logits, stats = build(size, base, is_training=True)
        with graph.as_default(), v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            values = {bare(v.name): sess.run(v) for v in v1.global_variables()}
            for name, value in values.items():
                if name.endswith("/gamma"):
                    values[name] = rng.uniform(0.6, 1.4, value.shape).astype(np.float32)
                elif name.endswith("/beta"):
                    values[name] = rng.normal(0, 0.2, value.shape).astype(np.float32)
                elif name.endswith("dense/bias"):
                    values[name] = rng.normal(0, 0.1, value.shape).astype(np.float32)
            assign_all(sess, graph, values)
            logits_train, batch_stats = sess.run([logits, stats], {x: x_in})
            bn_names = [
                bare(v.name)[: -len("/gamma")] for v in v1.global_variables() if v.name.endswith("/gamma:0")
            ]
            assert len(bn_names) == len(batch_stats)
            for bn, (mean, var) in zip(bn_names, batch_stats):
                values[f"{bn}/moving_mean"] = (
                    mean + 0.2 * np.sqrt(var) * rng.normal(size=mean.shape)
                ).astype(np.float32)
                values[f"{bn}/moving_variance"] = (var * rng.uniform(0.7, 1.4, var.shape)).astype(np.float32)
            assign_all(sess, graph, values)
            directory = os.path.join(OUT, tag)
            os.makedirs(directory, exist_ok=True)
            v1.train.Saver().save(
                sess, os.path.join(directory, "model.ckpt"), global_step=0, write_meta_graph=False
            )
            with open(os.path.join(directory, "checkpoint"), "w") as f:  # relative, as TF accepts: movable
                f.write('model_checkpoint_path: "model.ckpt-0"\nall_model_checkpoint_paths: "model.ckpt-0"\n')
        graph, x, logits, _ = build(size, base, is_training=False)
        with graph.as_default(), v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            assign_all(sess, graph, values)
            logits_eval = sess.run(logits, {x: x_in})
        arrays = {name: value for name, value in values.items() if name != "global_step"}
        np.savez_compressed(
            os.path.join(OUT, f"{tag}.npz"), logits_eval=logits_eval, logits_train=logits_train, **arrays
        )
        print(f"{tag}: logits eval {np.abs(logits_eval).max():.3f} train {np.abs(logits_train).max():.3f}")


def write_maxpool(rng):
    arrays = {}
    with tf.Graph().as_default(), v1.Session() as sess:
        for h, w in ((16, 16), (15, 15), (8, 7), (2, 1)):
            x = rng.normal(size=(1, h, w, 2)).astype(np.float32)
            arrays[f"x_{h}x{w}"] = x
            arrays[f"y_{h}x{w}"] = sess.run(tf.nn.max_pool2d(tf.constant(x), 3, 2, "SAME"))
    np.savez_compressed(os.path.join(OUT, "maxpool.npz"), **arrays)


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20171201)
    images = crops()
    np.savez_compressed(os.path.join(OUT, "images.npz"), images=images)
    write_variable_lists()
    write_reduced(images, rng)
    write_maxpool(rng)


if __name__ == "__main__":
    main()
