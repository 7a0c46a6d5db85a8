"""TensorFlow interop: the seeds' checkpoints read and written, and mapped onto fasttrain's state.

    table.py       the SSTable both checkpoint formats are built on (its byte layout in the docstring)
    checkpoint.py  TF checkpoints V1 and V2 (tensor bundle): open_checkpoint, write_checkpoint
    checkpoint_v1.py  the V1 (tensor slices) reader
    proto.py       TF's checkpoint protobuf messages and dtypes, shared by both readers
    names/         the name maps, one per seed family (fasttrain state_dict key <-> TF variable name)
    state.py       a TF run's variables <-> fasttrain's model, optimizer slots, EMA and step (import
                   for resume, pretrained weights and evaluation; export for convert to-tf)
    validate.py    step counters (global_step, local_step) checked: whole scalars in [0, 2**63)
    convert.py     the command: python -m fasttrain.tf.convert {from-tf, to-tf}

Nothing in the training loop depends on this package except where a user names a TF checkpoint.
"""
