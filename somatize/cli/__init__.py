"""The ``somatize`` command line (:mod:`~somatize.cli.main`) and what it shows: a job followed on
a console (:mod:`~somatize.cli.following`, in the words of :mod:`~somatize.cli.progress`),
tables (:mod:`~somatize.cli.tables`), curves and TensorBoard files (:mod:`~somatize.cli.curves`),
Ctrl-C while following (:mod:`~somatize.cli.interrupt`), others' text shown as what it says
(:mod:`~somatize.cli.visible_console`); the job files it submits
(:mod:`~somatize.cli.job_files`); and ``somatize demo`` (:mod:`~somatize.cli.demo`) on a
coordinator and workers of its own (:mod:`~somatize.cli.cluster`).
"""
