"""The dojo: the tooling a learner never edits, one folder per audience (``dojo dev check``
keeps the floors apart: ``dojo/dev/imports.py``).

The kata API, at the top: what ``katas/`` and ``solutions/`` import, and nothing else of dojo
    todo       KataTodo, the "not implemented yet" a stub raises
    console    a kata program's output (``say``, ``verdict``) and exit (``run_program``)
    launch     a program's ranks: ``launch_world`` and its command-line options
    devices    which backend and device a world runs on
    data       the offline digits (and MNIST) for the training katas
    models     the tutorial's ConvNet and its accuracy
    toy_models small models with a frozen layer, tied weights or a buffer (Part III), and
               the TinyTransformer Part IV cuts up

What every floor stands on
    curriculum/ every kata's steps, hints and files (its data: ``curriculum/*.toml``);
               ``curriculum/steps``: what a step is and where one is found (a todo in a
               failure or a source, a test's marker), for every floor; ``curriculum/stubs``
               makes a kata's stub from its reference's marked regions
    lang       the learner's language (English, Chinese) and ``t``, through which every
               sentence a learner reads is said in it (gettext: ``locale/LANG/LC_MESSAGES``)
    commands   how a learner types a command here; the packages a tool needs

``harness/``: the rank harness, which runs a world of rank processes (for the specs and for a
kata's own program)
    world      ``run_world``; rank.py is what each rank process runs, preload.py what its
               forkserver imports once
    stall      a world whose ranks all wait is a deadlock; stacks: where each rank waits
    calls      what a rank asked of torch.distributed, recorded (to count and order calls)
    timeline   every rank's calls as a timeline (Chrome trace JSON, PNG); mismatched
               collectives named early
    impl       katas or solutions under test, and the seam through which the maintainers'
               instruments reach every process
    loopback   worlds on one machine listen on 127.0.0.1 only (the store, gloo's interface)

``spec/``: the pytest side, what ``tests/`` imports besides the harness
    plugin     the pytest plugin (``kata``/``world`` fixtures, "not implemented yet" reports)
    report     what a learner sees of a failed test
    testing    running a kata's program, shared runs, free ports, GPU skips, bad-input probes
    states     model and optimizer states (and tensors) moved to the CPU and compared
    checkpoints what k15 and k16 hold a training's written and loaded state to, in their words
    collectives process groups and the collectives recorded on them, in the specs' words
    cuda       worlds on CUDA for the GPU tests: run_world's options, a rank's GPU
    meshes     what k28's and k36's specs share: a 2-D mesh's groups, refusals, calls' groups
    pipelines  what k21's and k27's specs share: micro-batches, a stage's place, a stuck schedule
    wrappers   what k12's and k13's specs ask of any hand-made DDP wrapper
    traces     a rank's own trace of its calls, written as it goes and read back by the test
    hosts      fake hosts: network namespaces with their own addresses (root, Linux)

``runner/``: the ``dojo`` command (learners and instructors); nothing outside it imports it but
``__main__`` and the tooling's tests.

``dev/``: the maintainers' only; nothing a learner runs imports it (``dojo dev`` hands over to it)
    check      the gate ``make test`` runs; consistency, imports, classroom: what it checks
    mistakes/  each kata's mistakes catalogue, run against its spec (``mistakes/plugin.py``)
    swaps      a catalogue's functions swapped in, in every process (an instrument)
    reach      which reference functions each test reaches (an instrument)
    messages   the message catalogues: extract, merge and compile (``dojo dev messages``)
    shipped/   the stubs the gate makes from ``solutions/`` and checks (git-ignored)

``tests/``: the tooling's own tests.
"""
