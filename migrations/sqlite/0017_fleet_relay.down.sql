DROP TABLE relayed_requests;
