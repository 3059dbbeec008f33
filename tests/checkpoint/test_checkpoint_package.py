def test_checkpoint_package_follows_the_rules(check_package):
    check_package("checkpoint")
