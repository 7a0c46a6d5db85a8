"""The ResNet seed's own input pipeline for bench/tf_input.py's "vgg" setting (TensorFlow only, no
torch or fasttrain): ucloud/uai-sdk examples/tensorflow/train/imagenet/code/imagenet.py
(ImagenetDataSet.parser and make_batch, is_training=True) and vgg_preprocessing.py
(preprocess_for_train and the helpers it calls), ported from TF 1.4 to TF 2's tf.data with the same
ops in the same order (tf.to_float -> tf.cast, tf.random_uniform -> tf.random.uniform, and the like):

    files shuffled (buffer 1024 x num_shards = 1024, the seed's _FILE_SHUFFLE_BUFFER for one tower),
    flat_map(TFRecordDataset), map(parser, num_parallel_calls=5), prefetch(2 x batch), shuffle(1500),
    repeat, batch.
    parser: parse_single_example (the seed's keys) -> decode_image(channels=3) ->
        convert_image_dtype(float32) -> preprocess_for_train(224, 224): side = U{256..512},
        _aspect_preserving_resize (float32 _smallest_size_at_least, resize_bilinear align_corners=False),
        _random_crop (the rank/size asserts, offsets U{0..H'-224}), random_flip_left_right, minus the
        means (123.68, 116.78, 103.94) / 255. float32 (N, 224, 224, 3).

The seed's shard file names (train-%05d-of-01024) are replaced by the data directory's shards; its
num_shards (GPUs) is 1, so the batch is not split; its make_one_shot_iterator becomes iteration.
"""

from __future__ import annotations

import glob
import os

import tensorflow as tf

_R_MEAN = 123.68 / 255
_G_MEAN = 116.78 / 255
_B_MEAN = 103.94 / 255
_RESIZE_SIDE_MIN = 256
_RESIZE_SIDE_MAX = 512
_FILE_SHUFFLE_BUFFER = 1024
_SHUFFLE_BUFFER = 1500


def _crop(image, offset_height, offset_width, crop_height, crop_width):
    original_shape = tf.shape(image)
    rank_assertion = tf.Assert(tf.equal(tf.rank(image), 3), ["Rank of image must be equal to 3."])
    with tf.control_dependencies([rank_assertion]):
        cropped_shape = tf.stack([crop_height, crop_width, original_shape[2]])
    size_assertion = tf.Assert(
        tf.logical_and(
            tf.greater_equal(original_shape[0], crop_height), tf.greater_equal(original_shape[1], crop_width)
        ),
        ["Crop size greater than the image size."],
    )
    offsets = tf.cast(tf.stack([offset_height, offset_width, 0]), tf.int32)
    with tf.control_dependencies([size_assertion]):
        image = tf.slice(image, offsets, cropped_shape)
    return tf.reshape(image, cropped_shape)


def _random_crop(image, crop_height, crop_width):
    """vgg_preprocessing._random_crop for a one-image list."""
    rank_assert = tf.Assert(tf.equal(tf.rank(image), 3), ["Wrong rank for tensor"])
    with tf.control_dependencies([rank_assert]):
        image_shape = tf.shape(image)
    image_height, image_width = image_shape[0], image_shape[1]
    crop_size_assert = tf.Assert(
        tf.logical_and(
            tf.greater_equal(image_height, crop_height), tf.greater_equal(image_width, crop_width)
        ),
        ["Crop size greater than the image size."],
    )
    with tf.control_dependencies([rank_assert, crop_size_assert]):
        max_offset_height = tf.reshape(image_height - crop_height + 1, [])
        max_offset_width = tf.reshape(image_width - crop_width + 1, [])
    offset_height = tf.random.uniform([], maxval=max_offset_height, dtype=tf.int32)
    offset_width = tf.random.uniform([], maxval=max_offset_width, dtype=tf.int32)
    return _crop(image, offset_height, offset_width, crop_height, crop_width)


def _mean_image_subtraction(image, means):
    channels = tf.split(axis=2, num_or_size_splits=3, value=image)
    for i in range(3):
        channels[i] -= means[i]
    return tf.concat(axis=2, values=channels)


def _smallest_size_at_least(height, width, smallest_side):
    smallest_side = tf.convert_to_tensor(smallest_side, dtype=tf.int32)
    height, width = tf.cast(height, tf.float32), tf.cast(width, tf.float32)
    smallest_side = tf.cast(smallest_side, tf.float32)
    scale = tf.cond(tf.greater(height, width), lambda: smallest_side / width, lambda: smallest_side / height)
    return tf.cast(height * scale, tf.int32), tf.cast(width * scale, tf.int32)


def _aspect_preserving_resize(image, smallest_side):
    smallest_side = tf.convert_to_tensor(smallest_side, dtype=tf.int32)
    shape = tf.shape(image)
    new_height, new_width = _smallest_size_at_least(shape[0], shape[1], smallest_side)
    image = tf.expand_dims(image, 0)
    resized_image = tf.compat.v1.image.resize_bilinear(image, [new_height, new_width], align_corners=False)
    resized_image = tf.squeeze(resized_image)
    resized_image.set_shape([None, None, 3])
    return resized_image


def preprocess_for_train(image, output_height, output_width):
    resize_side = tf.random.uniform([], minval=_RESIZE_SIDE_MIN, maxval=_RESIZE_SIDE_MAX + 1, dtype=tf.int32)
    image = _aspect_preserving_resize(image, resize_side)
    image = _random_crop(image, output_height, output_width)
    image.set_shape([output_height, output_width, 3])
    image = tf.cast(image, tf.float32)
    image = tf.image.random_flip_left_right(image)
    return _mean_image_subtraction(image, [_R_MEAN, _G_MEAN, _B_MEAN])


def parser(value, size: int):
    """ImagenetDataSet.parser(value, is_training=True)."""
    keys_to_features = {
        "image/encoded": tf.io.FixedLenFeature((), tf.string, default_value=""),
        "image/format": tf.io.FixedLenFeature((), tf.string, default_value="jpeg"),
        "image/class/label": tf.io.FixedLenFeature([], dtype=tf.int64, default_value=-1),
        "image/class/text": tf.io.FixedLenFeature([], dtype=tf.string, default_value=""),
        "image/object/bbox/xmin": tf.io.VarLenFeature(dtype=tf.float32),
        "image/object/bbox/ymin": tf.io.VarLenFeature(dtype=tf.float32),
        "image/object/bbox/xmax": tf.io.VarLenFeature(dtype=tf.float32),
        "image/object/bbox/ymax": tf.io.VarLenFeature(dtype=tf.float32),
        "image/object/class/label": tf.io.VarLenFeature(dtype=tf.int64),
    }
    parsed = tf.io.parse_single_example(value, keys_to_features)
    image = tf.image.decode_image(tf.reshape(parsed["image/encoded"], shape=[]), 3)
    image = tf.image.convert_image_dtype(image, dtype=tf.float32)
    image = preprocess_for_train(image, size, size)
    label = tf.cast(tf.reshape(parsed["image/class/label"], shape=[]), dtype=tf.int32)
    return image, label


def train_dataset(data_dir: str, size: int, batch: int) -> tf.data.Dataset:
    """ImagenetDataSet.make_batch(batch, is_training=True, num_shards=1, num_epochs=None)."""
    files = sorted(glob.glob(os.path.join(data_dir, "train-?????-of-?????")))
    if not files:
        raise FileNotFoundError(f"no train-NNNNN-of-NNNNN shards in {data_dir}")
    dataset = tf.data.Dataset.from_tensor_slices(files).shuffle(buffer_size=_FILE_SHUFFLE_BUFFER)
    dataset = dataset.flat_map(tf.data.TFRecordDataset)
    dataset = dataset.map(lambda value: parser(value, size), num_parallel_calls=5)
    dataset = dataset.prefetch(batch * 2)
    dataset = dataset.shuffle(buffer_size=_SHUFFLE_BUFFER)
    return dataset.repeat().batch(batch)
