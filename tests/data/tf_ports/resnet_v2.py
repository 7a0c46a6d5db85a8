"""The ResNet seed's resnet_model.py (ucloud/uai-sdk examples/tensorflow/train/imagenet/code/, Dec 2017)
ported to tf.compat.v1 graph mode for TensorFlow 2.x, for the fixture generators only (never imported by
a test or by fasttrain).

tf.layers is gone under Keras 3, so each layer is what TF 1.x's layer did: `get_variable` + the same
tf.nn op inside `variable_scope(None, default_name="conv2d" / "batch_normalization" / "dense")`, which is
how tf.layers named itself; under `variable_scope("resnet")` (imagenet_main.py's model_fn) the names are
exactly the seed's checkpoint names: resnet/conv2d_N/kernel, resnet/batch_normalization_N/{gamma, beta,
moving_mean, moving_variance}, resnet/dense/{kernel, bias}. channels_last (NHWC) only: the seed's
channels_first differs in layout, not in variables or values.

What TF 1.4 did and TF 2.21 does not, reproduced here:
- tf.variance_scaling_initializer() (scale 1, fan_in, "normal") drew truncated_normal(stddev =
  sqrt(1 / fan_in)); TF >= 1.12 divides the stddev by 0.8796.
- nn.fused_batch_norm raised epsilon to 1.001e-5 (`min_epsilon`); TF 2 passes 1e-5 through.
- layers.BatchNormalization(fused=True) moved the moving variance toward the fused op's batch variance,
  which is Bessel-corrected (`_bessels_correction_test_only = True`): fused_batch_norm's second and
  third outputs are used as they are.
`base_channels` (64 in the seed) scales every stage's width so that a reduced model keeps every layer.
"""

import math

import tensorflow as tf

v1 = tf.compat.v1

BATCH_NORM_DECAY = 0.997  # resnet_model.py _BATCH_NORM_DECAY
BATCH_NORM_EPSILON = max(1e-5, 1.001e-5)  # _BATCH_NORM_EPSILON, floored as TF 1.4's fused_batch_norm did

MODEL_PARAMS = {
    18: ("building", [2, 2, 2, 2]),
    34: ("building", [3, 4, 6, 3]),
    50: ("bottleneck", [3, 4, 6, 3]),
    101: ("bottleneck", [3, 4, 23, 3]),
    152: ("bottleneck", [3, 8, 36, 3]),
    200: ("bottleneck", [3, 24, 36, 3]),
}


def batch_norm_relu(inputs, is_training, stats=None):
    """batch_norm_relu: tf.layers.batch_normalization(axis=3, momentum=0.997, epsilon=1e-5, center,
    scale, fused=True) then ReLU. Training mode adds the moving-average updates to UPDATE_OPS and, when
    `stats` is a list, appends (batch mean, batch variance) for the generator."""
    channels = inputs.shape[-1]
    with v1.variable_scope(None, default_name="batch_normalization"):
        gamma = v1.get_variable("gamma", [channels], initializer=v1.ones_initializer())
        beta = v1.get_variable("beta", [channels], initializer=v1.zeros_initializer())
        moving_mean = v1.get_variable(
            "moving_mean", [channels], initializer=v1.zeros_initializer(), trainable=False
        )
        moving_variance = v1.get_variable(
            "moving_variance", [channels], initializer=v1.ones_initializer(), trainable=False
        )
        if is_training:
            out, mean, variance = v1.nn.fused_batch_norm(
                inputs, gamma, beta, epsilon=BATCH_NORM_EPSILON, is_training=True
            )
            one_minus_decay = 1.0 - BATCH_NORM_DECAY
            # layers' _assign_moving_average: variable -= (variable - value) * (1 - decay)
            for var, value in ((moving_mean, mean), (moving_variance, variance)):
                update = v1.assign_sub(var, (var - value) * one_minus_decay)
                v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, update)
            if stats is not None:
                stats.append((mean, variance))
        else:
            out, _, _ = v1.nn.fused_batch_norm(
                inputs,
                gamma,
                beta,
                mean=moving_mean,
                variance=moving_variance,
                epsilon=BATCH_NORM_EPSILON,
                is_training=False,
            )
    return tf.nn.relu(out)


def fixed_padding(inputs, kernel_size):
    pad_total = kernel_size - 1
    pad_beg = pad_total // 2
    pad_end = pad_total - pad_beg
    return tf.pad(inputs, [[0, 0], [pad_beg, pad_end], [pad_beg, pad_end], [0, 0]])


def conv2d_fixed_padding(inputs, filters, kernel_size, strides):
    """tf.layers.conv2d(use_bias=False, kernel_initializer=tf.variance_scaling_initializer()) with the
    seed's padding rule."""
    if strides > 1:
        inputs = fixed_padding(inputs, kernel_size)
    cin = int(inputs.shape[-1])
    fan_in = kernel_size * kernel_size * cin
    with v1.variable_scope(None, default_name="conv2d"):
        kernel = v1.get_variable(
            "kernel",
            [kernel_size, kernel_size, cin, filters],
            initializer=v1.truncated_normal_initializer(stddev=math.sqrt(1.0 / fan_in)),
        )
        return tf.nn.conv2d(
            inputs, kernel, strides=[1, strides, strides, 1], padding="SAME" if strides == 1 else "VALID"
        )


def building_block(inputs, filters, is_training, projection_shortcut, strides, stats):
    shortcut = inputs
    inputs = batch_norm_relu(inputs, is_training, stats)
    if projection_shortcut is not None:
        shortcut = projection_shortcut(inputs)
    inputs = conv2d_fixed_padding(inputs, filters, 3, strides)
    inputs = batch_norm_relu(inputs, is_training, stats)
    inputs = conv2d_fixed_padding(inputs, filters, 3, 1)
    return inputs + shortcut


def bottleneck_block(inputs, filters, is_training, projection_shortcut, strides, stats):
    shortcut = inputs
    inputs = batch_norm_relu(inputs, is_training, stats)
    if projection_shortcut is not None:
        shortcut = projection_shortcut(inputs)
    inputs = conv2d_fixed_padding(inputs, filters, 1, 1)
    inputs = batch_norm_relu(inputs, is_training, stats)
    inputs = conv2d_fixed_padding(inputs, filters, 3, strides)
    inputs = batch_norm_relu(inputs, is_training, stats)
    inputs = conv2d_fixed_padding(inputs, 4 * filters, 1, 1)
    return inputs + shortcut


def block_layer(inputs, filters, block_kind, blocks, strides, is_training, stats):
    block_fn = bottleneck_block if block_kind == "bottleneck" else building_block
    filters_out = 4 * filters if block_kind == "bottleneck" else filters

    def projection_shortcut(x):
        return conv2d_fixed_padding(x, filters_out, 1, strides)

    inputs = block_fn(inputs, filters, is_training, projection_shortcut, strides, stats)
    for _ in range(1, blocks):
        inputs = block_fn(inputs, filters, is_training, None, 1, stats)
    return inputs


def imagenet_resnet_v2(resnet_size, num_classes, inputs, is_training, base_channels=64, stats=None):
    """Logits (N, num_classes) of imagenet_resnet_v2(resnet_size, num_classes) on NHWC `inputs`; call it
    inside variable_scope("resnet") for the seed's names."""
    block_kind, layers = MODEL_PARAMS[resnet_size]
    w = base_channels
    inputs = conv2d_fixed_padding(inputs, w, 7, 2)
    inputs = tf.nn.max_pool2d(inputs, 3, 2, "SAME")
    for stage, blocks in enumerate(layers):
        inputs = block_layer(
            inputs, w * 2**stage, block_kind, blocks, 1 if stage == 0 else 2, is_training, stats
        )
    inputs = batch_norm_relu(inputs, is_training, stats)
    inputs = tf.nn.avg_pool2d(inputs, 7, 1, "VALID")
    features = int(inputs.shape[-1])
    inputs = tf.reshape(inputs, [-1, features])
    with v1.variable_scope(None, default_name="dense"):
        # tf.layers.dense: kernel (in, out) with get_variable's default Glorot uniform, bias zeros.
        kernel = v1.get_variable(
            "kernel", [features, num_classes], initializer=v1.glorot_uniform_initializer()
        )
        bias = v1.get_variable("bias", [num_classes], initializer=v1.zeros_initializer())
        return tf.matmul(inputs, kernel) + bias
