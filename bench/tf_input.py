"""TensorFlow's tf.data running the seeds' own training preprocessing: the peer row of
bench/bench_input.py. Imports tensorflow and bench/input_serve.py (the standard library) only, never
torch or fasttrain, so it runs in a TensorFlow-only interpreter; the driver starts it as a subprocess
with --tf-python, as `python -m bench.tf_input` with the repository root as the working directory.

resnet (TF official ResNet, tensorflow/models
official/vision/image_classification/resnet/imagenet_preprocessing.py: input_fn,
process_record_dataset, parse_example_proto, parse_record, preprocess_image with is_training=True):
    files shuffled, interleave(TFRecordDataset, cycle_length=10, AUTOTUNE), shuffle(10000), repeat,
    map(parse_record, AUTOTUNE), batch, prefetch(AUTOTUNE). preprocess_image: the crop window from
    sample_distorted_bounding_box(extract_jpeg_shape(jpeg), bbox, min_object_covered 0.1, aspect
    [0.75, 1.33], area [0.05, 1.0], 100 attempts, whole image without boxes), the fused
    decode_and_crop_jpeg, random_flip_left_right, compat.v1 resize BILINEAR align_corners=False to
    S x S, minus the channel means (123.68, 116.78, 103.94). float32 (N, S, S, 3).
inception (the Inception seed, tensorflow/models research/inception/inception/image_processing.py:
    batch_inputs, parse_example_proto, image_preprocessing with train=True):
    The seed's queue runners (string_input_producer, num_readers=4 readers into a RandomShuffleQueue
    of 1024 x 16 records, num_preprocess_threads copies of the graph, batch_join) do not exist in
    TF 2; as tf.data: files shuffled, interleave(cycle_length=4), shuffle(16384), repeat,
    map(AUTOTUNE), batch, prefetch(AUTOTUNE). image_preprocessing: decode_jpeg(channels=3),
    convert_image_dtype(float32); distort_image: the same sample_distorted_bounding_box on the
    decoded shape, slice, resize_images with method thread_id % 4 (bilinear, nearest, bicubic,
    area), random_flip_left_right, distort_color with ordering thread_id % 2 (brightness 32/255,
    saturation [0.5, 1.5], hue 0.2, contrast [0.5, 1.5] in one of the seed's two orders), clip to
    [0, 1]; then (x - 0.5) * 2. The seed's thread_id is the index of the preprocessing thread that
    built the graph copy; here it is drawn per image, U{0..3}, so the four methods and two orders
    occur at the seed's rates. float32 (N, S, S, 3).

vgg (the ResNet seed's imagenet.py + vgg_preprocessing): bench/tf_vgg.py.

All use TF's default thread pools (no private threadpool, the seeds' default); on this machine
AUTOTUNE's parallelism is bounded by the 2 cores.

    python -m bench.tf_input --data_dir DIR --setting resnet|inception|vgg --image_size S --batch 32
    (then the stdin protocol of bench/input_serve.py)
"""

from __future__ import annotations

import argparse
import functools
import glob
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: its C++ info lines

import tensorflow as tf  # noqa: E402

from bench.input_serve import serve  # noqa: E402

AUTOTUNE = tf.data.AUTOTUNE
CHANNEL_MEANS = [123.68, 116.78, 103.94]
RESNET_SHUFFLE_BUFFER = 10_000  # imagenet_preprocessing._SHUFFLE_BUFFER
INCEPTION_SHUFFLE_BUFFER = 1024 * 16  # examples_per_shard * input_queue_memory_factor
INCEPTION_READERS = 4  # image_processing's --num_readers


def parse_example_proto(serialized):
    """(jpeg bytes, label, bbox [1, num_boxes, 4] as ymin, xmin, ymax, xmax): both seeds' parser."""
    feature_map = {
        "image/encoded": tf.io.FixedLenFeature([], dtype=tf.string, default_value=""),
        "image/class/label": tf.io.FixedLenFeature([1], dtype=tf.int64, default_value=-1),
        "image/class/text": tf.io.FixedLenFeature([], dtype=tf.string, default_value=""),
    }
    for k in ("xmin", "ymin", "xmax", "ymax"):
        feature_map[f"image/object/bbox/{k}"] = tf.io.VarLenFeature(dtype=tf.float32)
    features = tf.io.parse_single_example(serialized, feature_map)
    label = tf.cast(features["image/class/label"], dtype=tf.int32)
    coords = [
        tf.expand_dims(features[f"image/object/bbox/{k}"].values, 0) for k in ("ymin", "xmin", "ymax", "xmax")
    ]
    bbox = tf.transpose(tf.expand_dims(tf.concat(coords, 0), 0), [0, 2, 1])
    return features["image/encoded"], label, bbox


def _sample_box(shape, bbox):
    return tf.compat.v1.image.sample_distorted_bounding_box(
        shape,
        bounding_boxes=bbox,
        min_object_covered=0.1,
        aspect_ratio_range=[0.75, 1.33],
        area_range=[0.05, 1.0],
        max_attempts=100,
        use_image_if_no_bounding_boxes=True,
    )


def resnet_train_image(jpeg, bbox, size: int):
    """imagenet_preprocessing.preprocess_image(..., is_training=True)."""
    begin, box_size, _ = _sample_box(tf.image.extract_jpeg_shape(jpeg), bbox)
    offset_y, offset_x, _ = tf.unstack(begin)
    height, width, _ = tf.unstack(box_size)
    image = tf.image.decode_and_crop_jpeg(jpeg, tf.stack([offset_y, offset_x, height, width]), channels=3)
    image = tf.image.random_flip_left_right(image)
    image = tf.compat.v1.image.resize(
        image, [size, size], method=tf.image.ResizeMethod.BILINEAR, align_corners=False
    )
    image.set_shape([size, size, 3])
    return image - tf.broadcast_to(CHANNEL_MEANS, tf.shape(image))


def distort_color(image, ordering):
    """image_processing.distort_color: the seed's two orders, chosen by ordering (0 or 1)."""

    def order0():
        x = tf.image.random_brightness(image, max_delta=32.0 / 255.0)
        x = tf.image.random_saturation(x, lower=0.5, upper=1.5)
        x = tf.image.random_hue(x, max_delta=0.2)
        return tf.image.random_contrast(x, lower=0.5, upper=1.5)

    def order1():
        x = tf.image.random_brightness(image, max_delta=32.0 / 255.0)
        x = tf.image.random_contrast(x, lower=0.5, upper=1.5)
        x = tf.image.random_saturation(x, lower=0.5, upper=1.5)
        return tf.image.random_hue(x, max_delta=0.2)

    return tf.clip_by_value(tf.cond(tf.equal(ordering, 0), order0, order1), 0.0, 1.0)


def inception_train_image(jpeg, bbox, size: int):
    """image_processing.image_preprocessing(..., train=True) with a per-image thread_id."""
    image = tf.image.convert_image_dtype(tf.image.decode_jpeg(jpeg, channels=3), dtype=tf.float32)
    thread_id = tf.random.uniform([], 0, 4, dtype=tf.int32)
    begin, box_size, _ = _sample_box(tf.shape(image), bbox)
    image = tf.slice(image, begin, box_size)
    # resize_images' ResizeMethod (v1) 0..3: bilinear, nearest neighbour, bicubic, area.
    branches = [
        functools.partial(tf.compat.v1.image.resize_images, image, [size, size], method=m) for m in range(4)
    ]
    image = tf.switch_case(thread_id % 4, branches)
    image.set_shape([size, size, 3])
    image = tf.image.random_flip_left_right(image)
    image = distort_color(image, thread_id % 2)
    return (image - 0.5) * 2.0


def train_dataset(data_dir: str, setting: str, size: int, batch: int) -> tf.data.Dataset:
    files = sorted(glob.glob(os.path.join(data_dir, "train-?????-of-?????")))
    if not files:
        raise FileNotFoundError(f"no train-NNNNN-of-NNNNN shards in {data_dir}")
    resnet = setting == "resnet"
    ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files))
    ds = ds.interleave(
        tf.data.TFRecordDataset, cycle_length=10 if resnet else INCEPTION_READERS, num_parallel_calls=AUTOTUNE
    )
    ds = ds.shuffle(RESNET_SHUFFLE_BUFFER if resnet else INCEPTION_SHUFFLE_BUFFER).repeat()
    preprocess = resnet_train_image if resnet else inception_train_image

    def parse(serialized):
        jpeg, label, bbox = parse_example_proto(serialized)
        return preprocess(jpeg, bbox, size), tf.reshape(label, [])

    ds = ds.map(parse, num_parallel_calls=AUTOTUNE).batch(batch, drop_remainder=True)
    return ds.prefetch(AUTOTUNE)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_dir", required=True)
    p.add_argument("--setting", choices=("resnet", "inception", "vgg"), required=True)
    p.add_argument("--image_size", type=int, required=True)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    if args.setting == "vgg":
        from bench import tf_vgg

        make = lambda: iter(tf_vgg.train_dataset(args.data_dir, args.image_size, args.batch))  # noqa: E731
    else:
        make = lambda: iter(train_dataset(args.data_dir, args.setting, args.image_size, args.batch))  # noqa: E731
    serve(
        make,
        lambda b: dict(shape=list(b[0].shape), dtype=b[0].dtype.name, version=tf.__version__),
    )


if __name__ == "__main__":
    main()
