"""The dojo: the tooling a learner never edits. Two halves, and who may import what.

The kata API (``katas/`` and ``solutions/`` import only these; ``dojo dev check`` keeps it so):
    todo       KataTodo, the "not implemented yet" a stub raises
    console    a kata program's output (``say``) and exit (``run_program``)
    launch     a program's ranks: ``launch_world`` and its command-line options
    devices    which backend and device a world runs on
    data       the offline digits (and MNIST) for the training katas
    models     the tutorial's ConvNet and its accuracy
    toy_models small models with a frozen layer, tied weights or a buffer (Part III), and
               the TinyTransformer Part IV cuts up

The test API (``tests/`` and the tooling use these too):
    world      the rank harness: ``run_world`` (rank.py is what each rank process runs)
    testing    running a kata's program, free ports, GPU skips, bad-input probes
    calls      what a rank asked of torch.distributed, recorded (to count and order calls)
    trace      every rank's calls as a timeline (Chrome trace JSON, PNG); mismatched
               collectives named early
    states     model and optimizer states moved to the CPU and compared
    hosts      fake hosts: network namespaces with their own addresses (root, Linux)
    impl       katas or solutions under test (and a catalogue's swaps)
    plugin     the pytest plugin (``kata``/``world`` fixtures, "not implemented yet" reports)
    curriculum every kata's steps, hints and files (its data: ``curriculum/*.toml``)

The runner (``dojo/runner/``: the ``dojo`` command; nothing outside it imports it but
``__main__`` and the tooling's tests): cli, learn, watch, progress, runs, steps, hints, reset,
solution, doctor, term, bench, trace, grade, testlog, and the maintainers' gate devcheck (with consistency
and imports).

Maintainers only: ``mistakes/`` (each kata's mistakes catalogue, run against its spec),
``tests/`` (the tooling's own tests), ``pristine/`` (the shipped stubs, for ``dojo reset``).
"""
