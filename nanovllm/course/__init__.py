"""The course mechanism: assignment regions in the package, student editions, grading.

* :mod:`nanovllm.course.regions` finds, validates and cuts ``# >>> assignment CC.name`` regions;
* :mod:`nanovllm.course.student` builds a student edition (``make student``);
* :mod:`nanovllm.course.grade` grades a student's package with the instructor's tests
  (``make grade``), through the pytest plugin :mod:`nanovllm.course.pytest_plugin`.
"""
