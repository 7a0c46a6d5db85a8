"""The named recipes: each the seed's changes to the base (Config's field defaults), as field values.

demo               a small ResNet on a synthetic set, trains on 2 CPU cores in well under 3 minutes
inception_v3       TensorFlow's Inception v3 multi-GPU trainer (RMSProp, EMA 0.9999, label smoothing,
                   aux head)
resnet50/101       the ResNet seed, the TF 1.4 ImageNet example: pre-activation ResNet v2, VGG
                   preprocessing, 1001 classes, LR 0.1 (no batch scaling) x0.1 at epochs 30/60/80/90,
                   one node's batch of 128 divided over its processes, 100 epochs, evaluation each epoch
resnet50/101_v1.5  TF official ResNet from 2018 on (v1.5, distorted-bbox crop, LR 0.1 x batch/256,
                   90 epochs): what MLPerf and NVIDIA's examples train

fasttrain/config.py makes each a Config (config.RECIPES, validated when config is imported), and
`make_config(recipe=..., **flags)` is one of those with the flags applied. This table imports nothing
from fasttrain: config.py, which defines the fields, reads it.
"""

from __future__ import annotations

# A small ResNet-18 (16 channels wide) at 64 px on a synthetic 10-class set: the whole run,
# data build included, took 13.5 s on 2 idle CPU cores and reached top-1 1.0 (chance 0.1).
DEMO = dict(
    recipe="demo",
    model="resnet18",
    base_channels=16,
    image_size=64,
    num_classes=10,
    label_offset=-1,
    batch_size=32,
    max_steps=300,
    optimizer="momentum",
    initial_learning_rate=0.1,
    lr_schedule="exponential",
    num_epochs_per_decay=2.0,
    learning_rate_decay_factor=0.5,
    weight_decay=5e-5,
    ema_decay=0.99,
    log_every=25,
    checkpoint_every=100,
    num_workers=2,
    shuffle_buffer=256,
    bn_momentum=0.1,
    data_backend="torch",
)

# The TF Inception v3 multi-GPU trainer (inception_train.py + inception_model.py).
INCEPTION_V3 = dict(
    recipe="inception_v3",
    model="inception_v3",
    image_size=299,
    preprocess="inception",
    color_distort=True,
    label_offset=0,
    num_classes=1001,
    batch_size=32,
    max_steps=10_000_000,
    optimizer="rmsprop",
    initial_learning_rate=0.1,
    lr_schedule="exponential",
    num_epochs_per_decay=30.0,
    learning_rate_decay_factor=0.16,
    momentum=0.9,
    rmsprop_decay=0.9,
    rmsprop_epsilon=1.0,
    weight_decay=4e-5,
    ema_decay=0.9999,
    label_smoothing=0.1,
    aux_loss_weight=0.4,
    no_decay_bn_bias=True,  # slim put L2 on conv and fc weights only
    bn_momentum=0.0003,
    bn_eps=0.001,
    zero_init_residual=False,
    checkpoint_every=5000,
)


def _resnet_seed(size: int) -> dict:
    # The ResNet seed, the TF 1.4 ImageNet example (ucloud/uai-sdk examples/tensorflow/train/imagenet/
    # code/, Dec 2017), as its code runs (its flags' defaults in imagenet_main.py):
    return dict(
        recipe=f"resnet{size}",
        model=f"resnet{size}_v2",  # _tower_fn: resnet_model.imagenet_resnet_v2(resnet_size, 1000 + 1)
        image_size=224,  # imagenet.py _DEFAULT_IMAGE_SIZE
        preprocess="vgg",  # imagenet.py parser: vgg_preprocessing.preprocess_image
        label_offset=0,  # the label as stored (1..1000), background 0 kept
        num_classes=1001,  # _LABEL_CLASSES
        # --train-batch-size 128 is one machine's, split int(batch_size / num_shards) per tower
        # (make_batch); batch_size is that on one process, what `python -m fasttrain` trains.
        node_batch_size=128,
        batch_size=128,
        eval_batch_size=100,  # --eval-batch-size, divided the same way
        max_steps=0,
        train_epochs=100.0,  # --train-epochs
        eval_every_epochs=1.0,  # --epochs_per_eval: train one epoch, evaluate all of validation
        optimizer="momentum",  # tf.train.MomentumOptimizer(learning_rate, momentum=0.9)
        initial_learning_rate=0.1,  # --learning-rate, no batch scaling
        lr_batch_scaling=False,
        # piecewise_constant at int(batches_per_epoch * e), e in 30/60/80/90, values lr x 1, 0.1, 0.01,
        # 1e-3, 1e-4; batches_per_epoch = 1,281,167 / (train_batch_size x workers), a float
        # (fasttrain/schedule.py)
        lr_schedule="piecewise",
        lr_boundary_epochs=[30.0, 60.0, 80.0, 90.0],
        learning_rate_decay_factor=0.1,
        momentum=0.9,
        # weight_decay * sum(tf.nn.l2_loss(v)) over tf.trainable_variables(): BN gamma/beta and the
        # dense bias included, so no exemption
        weight_decay=1e-4,
        no_decay_bn_bias=False,
        # resnet_model.py _BATCH_NORM_DECAY 0.997 (torch momentum 1 - decay, the same expression as
        # --batch-norm-decay's conversion) and _BATCH_NORM_EPSILON 1e-5, which TF 1.4's fused batch norm
        # (fused=True there) raised to its floor of 1.001e-5
        bn_momentum=1 - 0.997,
        bn_eps=1.001e-5,
        zero_init_residual=False,  # BN gamma initialised to 1 everywhere
        # make_batch: shard files shuffled, read one after another (flat_map), shuffle(1500)
        input_order="one_stream",
        shuffle_buffer=1500,
        checkpoint_every=5000,
    )


def _resnet_v15(size: int) -> dict:
    # TF official ResNet from 2018 on (v1.5 with the imagenet_preprocessing distorted-bbox crop), also
    # MLPerf's and NVIDIA's reference: momentum 0.9, 32 per device, LR 0.1 x batch/256, x0.1 at epochs
    # 30/60/80/90, weight decay 1e-4, 224 px, BN decay 0.997 eps 1e-5, 90 epochs. 1000 classes (the
    # stored labels 1..1000 less one), as NVIDIA's PyTorch example trains; TF official's own
    # imagenet_main.py keeps the background class (_NUM_CLASSES = 1001): --num_classes=1001
    # --label_offset=0 is that, with the same top-1 (no image has label 0).
    return dict(
        recipe=f"resnet{size}_v1.5",
        model=f"resnet{size}",
        image_size=224,
        preprocess="resnet",
        label_offset=-1,
        num_classes=1000,
        batch_size=32,
        max_steps=0,
        train_epochs=90.0,
        optimizer="momentum",
        initial_learning_rate=0.1,
        lr_batch_scaling=True,
        lr_schedule="piecewise",
        lr_boundary_epochs=[30.0, 60.0, 80.0, 90.0],
        learning_rate_decay_factor=0.1,
        momentum=0.9,
        weight_decay=1e-4,
        # resnet_run_loop.py: l2_loss over tf.trainable_variables() if loss_filter_fn(v.name), whose
        # default exclude_batch_norm leaves out 'batch_normalization' variables: the dense bias decays
        no_decay_bn=True,
        bn_momentum=0.003,
        bn_eps=1e-5,
        checkpoint_every=5000,
        eval_every_epochs=1.0,
    )


RECIPE_SETTINGS: dict[str, dict] = {
    settings["recipe"]: settings
    for settings in (
        DEMO,
        INCEPTION_V3,
        _resnet_seed(50),
        _resnet_seed(101),
        _resnet_v15(50),
        _resnet_v15(101),
    )
}
