"""The named recipes: each a Config, the base (Config's field defaults) plus the seed's changes.

demo          a small ResNet on a synthetic set, trains on 2 CPU cores in well under 3 minutes
inception_v3  TensorFlow's Inception v3 multi-GPU trainer (RMSProp, EMA 0.9999, label smoothing, aux head)
resnet50/101  the TF 1.4 ResNet ImageNet example (momentum, LR 0.1 x batch/256, steps at 30/60/80/90)

`make_config(recipe=..., **flags)` (fasttrain/config.py) is one of these with the flags applied.
"""

from __future__ import annotations

from fasttrain.config import Config

# A small ResNet-18 (16 channels wide) at 64 px on a synthetic 10-class set: the whole run,
# data build included, took 13.5 s on 2 idle CPU cores and reached top-1 1.0 (chance 0.1).
DEMO = Config(
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
INCEPTION_V3 = Config(
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


def _resnet(size: int) -> Config:
    # The TF 1.4 ResNet ImageNet example: momentum 0.9, 32 per device, LR 0.1 x batch/256,
    # x0.1 at epochs 30/60/80/90, weight decay 1e-4, 224 px, BN decay 0.997 eps 1e-5.
    return Config(
        recipe=f"resnet{size}",
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
        bn_momentum=0.003,
        bn_eps=1e-5,
        checkpoint_every=5000,
        eval_every_epochs=1.0,  # the seed's epochs_per_eval
    )


RECIPES: dict[str, Config] = {cfg.recipe: cfg for cfg in (DEMO, INCEPTION_V3, _resnet(50), _resnet(101))}
