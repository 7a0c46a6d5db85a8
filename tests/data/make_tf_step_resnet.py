"""Writes tests/data/tf-resnet-v2/step_resnet18_v2_w4.npz: three training steps of the ResNet seed as
TensorFlow takes them. Run once, in a scratch environment, after make_tf_resnet_v2.py, from the
repository root:

    TF_ENABLE_ONEDNN_OPTS=0 /opt/tfvenv/bin/python tests/data/make_tf_step_resnet.py   # tensorflow-cpu 2.21

The graph is the seed's (imagenet_main.py `_tower_fn` and `_resnet_model_fn`, one tower, ported to
tf.compat.v1 around tests/data/tf_ports/resnet_v2.py), is_training=True:
    logits  = imagenet_resnet_v2(18, 1001) at base width 4 under variable_scope("resnet")
    ce      = reduce_mean(losses.sparse_softmax_cross_entropy(logits, labels))
    l2      = add_n([nn.l2_loss(v) for v in trainable_variables()])     # sum(v^2) / 2, BN and bias too
    loss    = ce + 1e-4 * l2
    lr      = train.piecewise_constant(global_step, [int(b * e) for e in (30, 60, 80, 90)],
                                       [0.1, 0.01, 0.001, 1e-4, 1e-5]),  b = 1,281,167 / (4 * 1)
    train_op = group(MomentumOptimizer(lr, 0.9).apply_gradients(zip(tf.gradients(loss, vars), vars),
                                                              global_step), *UPDATE_OPS)
Started from resnet18_v2_w4/model.ckpt-0 (restored by Saver) with global_step set to the first boundary
minus 1, so the three steps run at steps b0 - 1, b0 (LR 0.1: piecewise_constant's x <= b0) and b0 + 1
(LR 0.01): the boundary rule is part of what is compared. Fed one fixed batch, the same each step: the
three images of images.npz and the first one flipped left-right, network input u8 / 255 - means / 255,
labels LABELS.

Stored (TF names, TF layouts): "lr", "loss", "ce", "l2" per step (shape (3,), the values the step
computed from its starting weights), "global_step_start"; and for step s = 1, 2, 3, after it:
"s{s}/<variable>" whole for every global variable (weights, BN moving statistics, the momentum slots
"<variable>/Momentum": steps 1 and 2 are the next steps' starting states), except, after step 3,
resnet/dense/kernel and its slot (32,000 values each at 1001 classes; the fixture stays under 2 MB),
which get "s{s}/<name>:sum", ":sumsq" (float64 sums), ":label_columns" (the columns of the batch's labels,
where the gradient is largest) and ":sample" (the elements at "dense_sample_index", 256 fixed flat indices).
"""

import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tf_ports"))
import resnet_v2 as port  # noqa: E402

v1 = tf.compat.v1
v1.disable_eager_execution()

DATA = os.path.join(os.path.dirname(__file__), "tf-resnet-v2")
MEANS = (123.68, 116.78, 103.94)
LABELS = np.array([1, 283, 1000, 500], np.int64)
BATCH = 4
WEIGHT_DECAY = 1e-4
STEPS = 3
# ResNet-18 at width 4, not the ResNet-50 at width 2 of the logits test: that one's training-mode
# gradients are chaotic in float32 (2-channel BNs over 49 layers: its own float32 and float64 gradients
# differ by up to 32% of a tensor's largest element; ResNet-18 w4's by 1.3e-5), so no implementation
# could match TF's there to better than tens of percent.
TAG, SIZE, BASE = "resnet18_v2_w4", 18, 4
SUMMARISED = ("resnet/dense/kernel", "resnet/dense/kernel/Momentum")


def batch():
    u8 = np.load(os.path.join(DATA, "images.npz"))["images"]
    u8 = np.concatenate([u8, u8[:1, :, ::-1]])
    return u8.astype(np.float32) / np.float32(255) - np.array(MEANS, np.float32) / np.float32(255)


def main():
    x = batch()
    graph = tf.Graph()
    with graph.as_default():
        global_step = v1.train.get_or_create_global_step()
        images = tf.constant(x)
        labels = tf.constant(LABELS)
        with v1.variable_scope("resnet"):
            logits = port.imagenet_resnet_v2(SIZE, 1001, images, True, base_channels=BASE)
        model_vars = v1.global_variables()
        ce = tf.reduce_mean(v1.losses.sparse_softmax_cross_entropy(logits=logits, labels=labels))
        params = v1.trainable_variables()
        l2 = tf.add_n([tf.nn.l2_loss(v) for v in params])
        loss = ce + WEIGHT_DECAY * l2
        grads = tf.gradients(loss, params)
        batches_per_epoch = 1281167 / (BATCH * 1)  # _NUM_IMAGES['train'] / (train_batch_size * workers)
        boundaries = [int(batches_per_epoch * epoch) for epoch in [30, 60, 80, 90]]
        staged_lr = [0.1 * decay for decay in [1, 0.1, 0.01, 1e-3, 1e-4]]
        lr = v1.train.piecewise_constant(global_step, boundaries, staged_lr)
        optimizer = v1.train.MomentumOptimizer(learning_rate=lr, momentum=0.9)
        update_ops = v1.get_collection(v1.GraphKeys.UPDATE_OPS)
        train_op = tf.group(
            optimizer.apply_gradients(list(zip(grads, params)), global_step=global_step), *update_ops
        )
        all_vars = v1.global_variables()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            v1.train.Saver(model_vars).restore(sess, os.path.join(DATA, TAG, "model.ckpt-0"))
            global_step.load(boundaries[0] - 1, sess)
            out = {"global_step_start": np.int64(boundaries[0] - 1), "labels": LABELS}
            rng = np.random.default_rng(5)
            dense_size = 8 * BASE * 1001
            out["dense_sample_index"] = np.sort(rng.choice(dense_size, 256, replace=False))
            record = {k: [] for k in ("lr", "loss", "ce", "l2")}
            for s in range(1, STEPS + 1):
                values = sess.run({"lr": lr, "loss": loss, "ce": ce, "l2": l2, "_": train_op})
                for k in record:
                    record[k].append(values[k])
                for v in all_vars:
                    name = v.name[: -len(":0")]
                    value = sess.run(v)
                    if name in SUMMARISED and s == STEPS:
                        out[f"s{s}/{name}:sum"] = value.astype(np.float64).sum()
                        out[f"s{s}/{name}:sumsq"] = np.square(value.astype(np.float64)).sum()
                        out[f"s{s}/{name}:label_columns"] = value[:, LABELS]
                        out[f"s{s}/{name}:sample"] = value.reshape(-1)[out["dense_sample_index"]]
                    else:
                        out[f"s{s}/{name}"] = value
                print(f"step {s}: lr {values['lr']:.4g} loss {values['loss']:.6f} ce {values['ce']:.6f}")
            for k, v in record.items():
                out[k] = np.array(v, np.float32)
    np.savez_compressed(os.path.join(DATA, f"step_{TAG}.npz"), **out)


if __name__ == "__main__":
    main()
