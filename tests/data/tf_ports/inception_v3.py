"""The Inception seed's network and train op, ported to tf.compat.v1 graph mode (fixture generators only).

A transcription of tensorflow/models inception/inception/slim/inception_model.py (inception_v3),
slim/ops.py (conv2d, batch_norm, fc, avg_pool, max_pool, dropout), inception_model.py (inference's
arg scopes, loss) and inception_train.py (_tower_loss, train op), with slim's helpers replaced by
`tf.compat.v1.get_variable` inside `tf.compat.v1.variable_scope(scope, default_name)` exactly as slim
opened them, so every variable name (conv0/weights, mixed_35x35x256a/branch5x5/Conv_1/BatchNorm/beta,
aux_logits/FC/biases, logits/logits/weights, ...) is the seed's. Runs on TF 2.21 with eager off.

`depth_multiplier` (not in the seed) scales every channel count c to max(1, int(c * m)), the rule
of fasttrain.models.inception_v3; 1.0 is the seed's network.
"""

import tensorflow as tf
from tensorflow.python.training import moving_averages  # as slim/ops.py imports it

v1 = tf.compat.v1
UPDATE_OPS = "_update_ops_"  # slim.ops.UPDATE_OPS_COLLECTION
LOSSES = "_losses"  # slim.losses.LOSSES_COLLECTION
BN_DECAY, BN_EPS, WEIGHT_DECAY = 0.9997, 0.001, 0.00004  # inception_model.py inference()
RMSPROP_DECAY, RMSPROP_MOMENTUM, RMSPROP_EPSILON = 0.9, 0.9, 1.0  # inception_train.py
MOVING_AVERAGE_DECAY = 0.9999  # inception_model.py


def _l2(t):  # slim.losses.l2_regularizer(weight_decay)
    return tf.multiply(tf.constant(WEIGHT_DECAY, t.dtype), tf.nn.l2_loss(t), name="value")


def batch_norm(x, is_training):
    """slim.ops.batch_norm(decay=0.9997, epsilon=0.001, scale=False): beta, moving mean/variance."""
    with v1.variable_scope(None, "BatchNorm", [x]):
        shape = x.shape[-1:]
        beta = v1.get_variable("beta", shape, initializer=v1.zeros_initializer())
        moving = [v1.GraphKeys.GLOBAL_VARIABLES, v1.GraphKeys.MOVING_AVERAGE_VARIABLES]
        kw = dict(trainable=False, collections=moving)
        moving_mean = v1.get_variable("moving_mean", shape, initializer=v1.zeros_initializer(), **kw)
        moving_variance = v1.get_variable("moving_variance", shape, initializer=v1.ones_initializer(), **kw)
        if is_training:
            mean, variance = tf.nn.moments(x, [0, 1, 2])
            # assign_moving_average's default zero_debias=True, as slim called it.
            v1.add_to_collection(
                UPDATE_OPS, moving_averages.assign_moving_average(moving_mean, mean, BN_DECAY)
            )
            v1.add_to_collection(
                UPDATE_OPS, moving_averages.assign_moving_average(moving_variance, variance, BN_DECAY)
            )
        else:
            mean, variance = moving_mean, moving_variance
        return tf.nn.batch_normalization(x, mean, variance, beta, None, BN_EPS)


def conv2d(x, cout, kernel, is_training, stride=1, padding="SAME", stddev=0.1, scope=None):
    """slim.ops.conv2d with the seed's arg scopes: conv (no bias) -> batch_norm -> relu."""
    with v1.variable_scope(scope, "Conv", [x]):
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        w = v1.get_variable(
            "weights",
            [kh, kw, x.shape[-1], cout],
            initializer=v1.truncated_normal_initializer(stddev=stddev),
            regularizer=_l2,
        )
        y = tf.nn.conv2d(x, w, [1, stride, stride, 1], padding=padding)
        return tf.nn.relu(batch_norm(y, is_training))


def fc(x, units, stddev, scope=None):
    """slim.ops.fc(activation=None) with weight decay: x @ weights + biases."""
    with v1.variable_scope(scope, "FC", [x]):
        w = v1.get_variable(
            "weights",
            [x.shape[-1], units],
            initializer=v1.truncated_normal_initializer(stddev=stddev),
            regularizer=_l2,
        )
        b = v1.get_variable("biases", [units], initializer=v1.zeros_initializer())
        return tf.compat.v1.nn.xw_plus_b(x, w, b)


def _pool(op, x, k, stride, padding):
    return op(x, [1, k, k, 1], [1, stride, stride, 1], padding)


def inception_v3(images, num_classes, is_training, depth_multiplier=1.0, dropout_keep_prob=0.8):
    """(logits, aux_logits) for NHWC images; slim/inception_model.py inception_v3, layer for layer."""

    def d(c):
        return max(1, int(c * depth_multiplier))

    def conv(x, c, k, **kw):
        return conv2d(x, d(c), k, is_training, **kw)

    def avg(x, k=3, stride=1, padding="SAME"):
        return _pool(tf.nn.avg_pool2d, x, k, stride, padding)

    def maxp(x):
        return _pool(tf.nn.max_pool2d, x, 3, 2, "VALID")

    net = conv(images, 32, 3, stride=2, padding="VALID", scope="conv0")
    net = conv(net, 32, 3, padding="VALID", scope="conv1")
    net = conv(net, 64, 3, padding="SAME", scope="conv2")
    net = maxp(net)  # pool1
    net = conv(net, 80, 1, padding="VALID", scope="conv3")
    net = conv(net, 192, 3, padding="VALID", scope="conv4")
    net = maxp(net)  # pool2
    for name, pool_features in (("mixed_35x35x256a", 32), ("mixed_35x35x288a", 64), ("mixed_35x35x288b", 64)):
        with v1.variable_scope(name):
            with v1.variable_scope("branch1x1"):
                b1 = conv(net, 64, 1)
            with v1.variable_scope("branch5x5"):
                b5 = conv(conv(net, 48, 1), 64, 5)
            with v1.variable_scope("branch3x3dbl"):
                b3 = conv(conv(conv(net, 64, 1), 96, 3), 96, 3)
            with v1.variable_scope("branch_pool"):
                bp = conv(avg(net), pool_features, 1)
            net = tf.concat([b1, b5, b3, bp], 3)
    with v1.variable_scope("mixed_17x17x768a"):
        with v1.variable_scope("branch3x3"):
            b3 = conv(net, 384, 3, stride=2, padding="VALID")
        with v1.variable_scope("branch3x3dbl"):
            b3d = conv(conv(conv(net, 64, 1), 96, 3), 96, 3, stride=2, padding="VALID")
        with v1.variable_scope("branch_pool"):
            bp = maxp(net)
        net = tf.concat([b3, b3d, bp], 3)
    for name, c7 in (
        ("mixed_17x17x768b", 128),
        ("mixed_17x17x768c", 160),
        ("mixed_17x17x768d", 160),
        ("mixed_17x17x768e", 192),
    ):
        with v1.variable_scope(name):
            with v1.variable_scope("branch1x1"):
                b1 = conv(net, 192, 1)
            with v1.variable_scope("branch7x7"):
                b7 = conv(conv(conv(net, c7, 1), c7, [1, 7]), 192, [7, 1])
            with v1.variable_scope("branch7x7dbl"):
                b7d = conv(net, c7, 1)
                for c, k in ((c7, [7, 1]), (c7, [1, 7]), (c7, [7, 1]), (192, [1, 7])):
                    b7d = conv(b7d, c, k)
            with v1.variable_scope("branch_pool"):
                bp = conv(avg(net), 192, 1)
            net = tf.concat([b1, b7, b7d, bp], 3)
    with v1.variable_scope("aux_logits"):
        aux = avg(net, 5, 3, "VALID")
        aux = conv(aux, 128, 1, scope="proj")
        aux = conv(aux, 768, list(aux.shape[1:3]), stddev=0.01, padding="VALID")
        aux = fc(tf.reshape(aux, [-1, aux.shape[1] * aux.shape[2] * aux.shape[3]]), num_classes, 0.001)
    with v1.variable_scope("mixed_17x17x1280a"):
        with v1.variable_scope("branch3x3"):
            b3 = conv(conv(net, 192, 1), 320, 3, stride=2, padding="VALID")
        with v1.variable_scope("branch7x7x3"):
            b7 = conv(conv(conv(net, 192, 1), 192, [1, 7]), 192, [7, 1])
            b7 = conv(b7, 192, 3, stride=2, padding="VALID")
        with v1.variable_scope("branch_pool"):
            bp = maxp(net)
        net = tf.concat([b3, b7, bp], 3)
    for name in ("mixed_8x8x2048a", "mixed_8x8x2048b"):
        with v1.variable_scope(name):
            with v1.variable_scope("branch1x1"):
                b1 = conv(net, 320, 1)
            with v1.variable_scope("branch3x3"):
                b3 = conv(net, 384, 1)
                b3 = tf.concat([conv(b3, 384, [1, 3]), conv(b3, 384, [3, 1])], 3)
            with v1.variable_scope("branch3x3dbl"):
                b3d = conv(conv(net, 448, 1), 384, 3)
                b3d = tf.concat([conv(b3d, 384, [1, 3]), conv(b3d, 384, [3, 1])], 3)
            with v1.variable_scope("branch_pool"):
                bp = conv(avg(net), 192, 1)
            net = tf.concat([b1, b3, b3d, bp], 3)
    with v1.variable_scope("logits"):
        net = avg(net, net.shape[1], 1, "VALID")  # pool: the whole 8x8 map
        if is_training and dropout_keep_prob < 1.0:  # slim.ops.dropout: identity at keep 1 or in eval
            net = tf.nn.dropout(net, rate=1.0 - dropout_keep_prob)
        net = tf.reshape(net, [-1, net.shape[-1]])
        logits = fc(net, num_classes, 0.001, scope="logits")
    return logits, aux


def tower_loss(logits, aux_logits, labels, num_classes):
    """inception_model.loss + inception_train._tower_loss: {name: scalar} of the parts and the total."""
    dense = tf.one_hot(labels, num_classes)

    def cross_entropy(x, weight, scope):  # slim.losses.cross_entropy_loss(label_smoothing=0.1)
        with tf.name_scope(scope):
            smooth = dense * (1.0 - 0.1) + 0.1 / num_classes
            ce = tf.nn.softmax_cross_entropy_with_logits(labels=smooth, logits=x)
            loss = tf.multiply(weight, tf.reduce_mean(ce), name="value")
            v1.add_to_collection(LOSSES, loss)
            return loss

    parts = {"cross_entropy": cross_entropy(logits, 1.0, "CrossEntropyLoss")}
    parts["aux_loss"] = cross_entropy(aux_logits, 0.4, "aux_loss")
    parts["regularization"] = tf.add_n(v1.get_collection(v1.GraphKeys.REGULARIZATION_LOSSES))
    parts["total_loss"] = tf.add_n(
        v1.get_collection(LOSSES) + v1.get_collection(v1.GraphKeys.REGULARIZATION_LOSSES)
    )
    return parts


def train_op(total_loss, global_step, lr):
    """inception_train.train's op: RMSProp, EMA of trainable + moving-average variables, BN updates.

    The seed groups the three with no order between them (tf.group), so which values the EMA reads
    (before or after this step's update and global_step increment) is a race in the seed. Fixed here
    as fasttrain orders it: gradients applied and BN statistics updated first, then the EMA with
    num_updates = the incremented global_step.
    """
    opt = v1.train.RMSPropOptimizer(lr, RMSPROP_DECAY, momentum=RMSPROP_MOMENTUM, epsilon=RMSPROP_EPSILON)
    apply_op = opt.apply_gradients(opt.compute_gradients(total_loss), global_step=global_step)
    bn_updates = tf.group(*v1.get_collection(UPDATE_OPS))
    ema = v1.train.ExponentialMovingAverage(MOVING_AVERAGE_DECAY, global_step)
    to_average = v1.trainable_variables() + v1.moving_average_variables()
    with tf.control_dependencies([apply_op, bn_updates]):
        return ema.apply(to_average)
