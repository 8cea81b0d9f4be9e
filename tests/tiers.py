"""The quick tier: ``make test-quick`` runs every test not marked ``slow``, in about a third
of the whole suite's time, for the edit-test loop; ``make test`` (and CI) runs everything.

A test is slow here when it launches processes (each imports JAX and compiles its own
programs) or took 6 s or more in a measured run of the whole suite on 2 cores
(``pytest -n 2 --junitxml=...``; the list below is that run's). They are marked from this
one list rather than test by test, so the tier is one decision in one place. A listed test
function that no longer exists is an error, so a rename cannot drop it from the list.
"""

import pytest

#: Modules whose tests launch processes.
SLOW_MODULES = frozenset(
    {
        "test_cluster.py",
        "test_cluster_tta.py",
        "test_collective.py",
        "test_examples.py",
        "test_gpu_check.py",
        "test_multiprocess.py",
        "test_process_faults.py",
    }
)

#: Other slow tests, per module: a test's name (every parametrization) or one node's name.
SLOW_TESTS: dict[str, frozenset[str]] = {
    module: frozenset(names)
    for module, names in {
        "test_bench.py": ["test_every_schedule_and_dp_has_positive_numbers"],
        "test_doc_blocks.py": [
            "test_python_blocks_run[README.md]",
            "test_script_lines_parse_with_the_scripts_own_parsers",
        ],
        "test_calibrate.py": [
            "test_measure_and_calibrate_a_tiny_model",
            "test_the_command_line_calibrates_and_plan_and_simulate_read_it",
        ],
        "test_checkpoint.py": [
            "test_a_save_killed_midway_leaves_the_previous_step",
            "test_a_template_of_another_model_or_plan_names_the_first_mismatch",
            "test_pipeline_round_trip_with_replication_and_adam",
            "test_round_trip_and_resume_are_bit_identical[1f1b]",
            "test_round_trip_and_resume_are_bit_identical[pipedream]",
        ],
        "test_cli.py": [
            f"test_profile_every_tiny_model[{model}]"
            for model in ("vgg16", "alexnet", "resnet50", "gnmt", "awd_lm")
        ],
        "test_cli_fuzz.py": ["test_simulate_numeric_options[--stages]"],
        "test_device_ids.py": ["test_plan_on_devices_4_to_7_lands_there"],
        "test_dp.py": ["test_cnn_learns_digits"],
        "test_models.py": ["test_output_shapes[gnmt]"],
        "test_pipeline.py": [
            "test_flush_schedules_equal_gradient_accumulation_mlp[1-gpipe]",
            "test_flush_schedules_equal_gradient_accumulation_mlp[2-gpipe]",
            "test_flush_schedules_equal_gradient_accumulation_mlp[4-gpipe]",
            "test_models_and_replication[cnn-1f1b-2-3-2]",
            "test_models_and_replication[resnet50-gpipe-3-3-1]",
            "test_models_and_replication[gpt-zb-h1-2-2-1]",
            "test_models_and_replication[gpt-1f1b-2-4-2]",
            "test_more_bad_input_is_caught_with_a_hint",
        ],
        "test_precision.py": [
            "test_params_f32_activations_bf16_output_f32_grads_f32",
            "test_pipeline_1f1b_equals_a_single_device_loop",
        ],
        "test_profile.py": ["test_each_program_compiles_once_and_identical_layers_share_theirs"],
        "test_replication.py": [
            "test_check_parts_on_real_model",
            "test_each_device_keeps_its_own_rows_gradient",
            "test_one_all_reduce_per_update_none_in_a_backward",
            "test_per_device_sums_equal_sequential_training[1f1b]",
            "test_per_device_sums_equal_sequential_training[interleaved]",
            "test_stages_that_mix_rows_stay_whole_and_exact",
        ],
        "test_round_robin.py": [
            f"test_pipedream_round_robin_equals_its_recurrence[{case}]"
            for case in (
                "bounds0-replicas0-sgd",
                "bounds2-replicas2-adam",
                "bounds3-replicas3-sgd",
                "bounds4-replicas4-adam",
            )
        ],
        "test_runtime.py": [
            "test_async_schedules_with_replication_and_batchnorm",
            "test_global_norm_clipping_equals_sequential_training[1f1b]",
            "test_init_builds_each_stage_on_its_own_devices",
            "test_remat_through_the_pipeline",
        ],
        "test_schedule.py": ["test_every_generator_passes_the_validator[8]"],
        "test_semantics.py": ["test_dropout_streams_match_the_reference_rng"],
        "test_tied.py": ["test_a_global_norm_checkpoint_moves_between_one_stage_and_several"],
        "test_train.py": [
            "test_cli_trains_compares_and_writes_metrics_and_plots",
            "test_dp_and_a_flush_schedule_run_the_same_loop",
            "test_pipedream_learns_digits_and_stops_at_target",
            "test_resume_continues_bit_identically",
            "test_schedule_auto_profiles_plans_and_trains",
        ],
        "test_train_faults.py": [
            "test_a_resume_follows_the_plan_the_run_started_with",
            "test_a_resumed_schedule_auto_run_keeps_its_choice",
            "test_metrics_follow_commits_and_resumes_write_each_epoch_once",
        ],
        "test_user_models.py": [
            "test_checkpoint_from_four_stages_resumes_under_two",
            "test_linen_cnn_1f1b_equals_sequential_training_and_comes_back_as_the_users_tree",
            "test_nnx_dropout_is_on_in_training_and_off_in_evaluation",
            "test_nnx_transformer_1f1b_equals_the_users_own_training_loop",
            "test_nnx_transformer_untied_under_pipedream_equals_the_delayed_update_recurrence",
        ],
        "test_zero_bubble.py": ["test_runtime_equals_gradient_accumulation"],
    }.items()
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: left out of the quick tier, make test-quick (tests/tiers.py)"
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks set here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    modules = {}
    for item in items:
        name = item.path.name
        modules.setdefault(name, getattr(item, "module", None))
        names = {item.name, getattr(item, "originalname", item.name)}
        if name in SLOW_MODULES or names & SLOW_TESTS.get(name, frozenset()):
            item.add_marker(pytest.mark.slow)
    stale = [
        f"{name}::{test}"
        for name, module in modules.items()
        if module is not None
        for test in sorted(SLOW_TESTS.get(name, ()))
        if not hasattr(module, test.split("[")[0])
    ]
    if stale:
        raise pytest.UsageError(f"tests/tiers.py names tests that do not exist: {stale}")
